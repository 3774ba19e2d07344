"""The agent on a real GPU and driver, with real CUDA tenants in cgroups laid out as the
kubelet lays them: what the driver model (gpusource.drivermodel) claims, checked on the driver
it was measured on.

    make test-gpu     # GPUUSAGE_GPU_FIGURES=figures.json to keep the figures
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpuusage_nodeagent.activity import seconds_needed
from gpuusage_nodeagent.driverfacts import CONTEXT_ALLOWANCE_MIB
from gpuusage_nodeagent.gpusource.drivermodel import MPS_SERVER
from gpuusage_nodeagent.main import wait_polling
from gpuusage_nodeagent.report import AttributedReading
from gpuusage_nodeagent.share import DEFAULT_READ_EVERY, DEFAULT_WINDOW, ShareSchedule
from gpuusage_nodeagent.visibility import REASON, unexplained_mib
from tests.gpu.machine import REPO, Pod, Tenants, agent, cycles, memsets


def _first_gpu(read: AttributedReading) -> Any:
    return read.spec().gpus[0]


def _processes(read: AttributedReading, pids: set[int]) -> dict[int, Any]:
    return {p.pid: p for p in _first_gpu(read).processes if p.pid in pids}


def _driver(figures: dict[str, Any]) -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    figures.setdefault("gpu", pynvml.nvmlDeviceGetName(handle))
    figures.setdefault("driver", pynvml.nvmlSystemGetDriverVersion())


@pytest.mark.parametrize("driver", ["systemd", "cgroupfs"])
def test_attribution_through_kubelet_cgroups_and_a_forged_one(
    tenants: Tenants, cgroups: Path, driver: str, figures: dict[str, Any]
) -> None:
    """Each tenant is its pod's; a tenant that nests another pod's cgroup path inside its own
    container stays its own pod's; one in its own pid namespace is listed by its host pid."""
    _driver(figures)
    owner, victim, hidden = Pod(), Pod(), Pod()
    plain = tenants.start(mib=512, cgroup=owner.cgroup(cgroups, driver))
    forged_path = owner.cgroup(cgroups, driver) / victim.cgroup(Path("x"), driver).relative_to("x")
    forged = tenants.start(mib=256, cgroup=forged_path)
    namespaced = tenants.start(
        mib=256, cgroup=hidden.cgroup(cgroups, driver), own_pid_namespace=True
    )
    read = agent().read()
    found = _processes(read, {plain, forged, namespaced})
    assert set(found) == {plain, forged, namespaced}, "host pids, the namespaced one's too"
    assert (found[plain].pod_uid, found[plain].container_id) == (owner.uid, owner.container_id)
    assert found[forged].pod_uid == owner.uid, "a forged nested cgroup stays its own pod's"
    assert found[namespaced].pod_uid == hidden.uid


def test_memory_matches_nvidia_smi(tenants: Tenants, figures: dict[str, Any]) -> None:
    pids = {tenants.start(mib=mib) for mib in (256, 1024, 3072)}
    read = agent().read()
    smi = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    theirs = {int(p): int(m) for p, m in (line.split(",") for line in smi.strip().splitlines())}
    ours = {pid: p.used_memory_mib for pid, p in _processes(read, pids).items()}
    assert ours == {pid: theirs[pid] for pid in pids}
    figures["memory_mib_vs_nvidia_smi"] = {str(k): v for k, v in ours.items()}


@pytest.mark.parametrize("contexts", [64, 96])
def test_many_listed_contexts_are_not_blind(
    tenants: Tenants, contexts: int, figures: dict[str, Any]
) -> None:
    """The driver's bookkeeping per context (5.8 MiB measured) is not taken for a hidden
    process: every tenant listed, the device is not blind."""
    pids = set(tenants.start_many(contexts, mib=64, busy=0.0))
    read = agent().read()
    gpu = _first_gpu(read)
    listed = [p for p in read.reading.processes_of(gpu)]
    assert pids <= {p.pid for p in listed}
    assert gpu.error is None, gpu.error
    unexplained = unexplained_mib(gpu.memory, listed)
    figures[f"unexplained_mib_at_{len(listed)}_contexts"] = unexplained
    assert unexplained is not None
    assert unexplained <= 256 + CONTEXT_ALLOWANCE_MIB * len(listed)


@pytest.mark.parametrize("own_proc", [True, False])
def test_an_agent_without_host_pid_sees_the_device_blind(tenants: Tenants, own_proc: bool) -> None:
    """In its own pid namespace the open kernel module lists nothing to the agent: the device
    is ProcessesNotVisible with the hostPID hint, never "nothing runs"; both with its own /proc
    and with the host's."""
    tenants.start(mib=2048)
    command = ["unshare", "--pid", "--fork", *(["--mount-proc"] if own_proc else [])]
    command += [sys.executable, "-m", "gpuusage", "agent", "--once", "--output", "json"]
    command += ["--node-name", "gpu-test-node", "--gpu-source", "nvml", "--metrics-port", "0"]
    out = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, check=True, env=_child_env()
    ).stdout
    gpu = json.loads(out)["spec"]["gpus"][0]
    assert gpu["error"]["reason"] == REASON
    assert "hostPID" in gpu["error"]["message"]


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_no_busy_tenant_is_published_idle_among_32_with_a_4_second_window(
    tenants: Tenants, figures: dict[str, Any]
) -> None:
    """The measured failure (20 of 32 busy tenants published idle with a 4 s window): none,
    over a minute of cycles every second."""
    pids = set(tenants.start_many(32, mib=64, busy=1.0))
    reader = agent(window=4)
    idle: set[int] = set()
    unsure: set[int] = set()
    for read in cycles(reader, 60):
        idle |= {pid for pid, p in _processes(read, pids).items() if p.idle_since}
        unsure |= {pid for pid, p in _processes(read, pids).items() if p.activity_unknown}
    figures["busy_32_window_4s"] = {
        "published_idle": len(idle),
        "unsure_at_some_cycle": len(unsure),
    }
    assert idle == set()


def test_a_lone_idle_tenant_beside_a_busy_one_is_found(
    tenants: Tenants, figures: dict[str, Any]
) -> None:
    busy = tenants.start(mib=1024, busy=1.0)
    quiet = tenants.start(mib=4096, busy=0.0)
    reader = agent(window=10)
    started = time.monotonic()
    found = None
    for read in cycles(reader, 10 + seconds_needed(2) + 20):
        procs = _processes(read, {busy, quiet})
        assert procs[busy].idle_since is None
        if procs[quiet].idle_since is not None:
            found = time.monotonic() - started
            break
    figures["lone_idle_found_after_s"] = found
    assert found is not None


def test_no_blind_read_while_tenants_are_killed(tenants: Tenants, figures: dict[str, Any]) -> None:
    pids = tenants.start_many(3, mib=2048, busy=0.5)
    reader = agent()
    reads, blind, done = [0], [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            read = reader.read()
            reads[0] += 1
            blind[0] += any(g.error is not None for g in read.reading.gpus)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for pid in pids:
        time.sleep(1.0)
        tenants.kill(pid)
    time.sleep(2.0)
    done.set()
    watcher.join()
    figures["reads_while_killing"] = {"reads": reads[0], "blind_or_failed": blind[0]}
    assert reads[0] > 10
    assert blind[0] == 0


def test_attribution_while_tenants_come_and_go(
    tenants: Tenants, cgroups: Path, figures: dict[str, Any]
) -> None:
    """The resolver tells a pid's process apart by its stat file's identity: tenants killed
    and new ones started between cycles are each their own pod's at every cycle."""
    pods = [Pod() for _ in range(4)]
    pids = {tenants.start(mib=256, cgroup=pod.cgroup(cgroups, "systemd")): pod for pod in pods}
    reader = agent()
    first = _processes(reader.read(), set(pids))
    assert {pid: p.pod_uid for pid, p in first.items()} == {pid: p.uid for pid, p in pids.items()}
    gone = list(pids)[:2]
    for pid in gone:
        tenants.kill(pid)
        del pids[pid]
    newer = [Pod() for _ in range(2)]
    pids |= {tenants.start(mib=256, cgroup=pod.cgroup(cgroups, "cgroupfs")): pod for pod in newer}
    reads = 0
    for read in cycles(reader, 30, every=0.5):
        reads += 1
        listed = {p.pid for p in _first_gpu(read).processes}
        found = _processes(read, set(pids))
        assert {pid: p.pod_uid for pid, p in found.items()} == {
            pid: pids[pid].uid for pid in found
        }, "every listed tenant its own pod's"
        if set(pids) <= listed and not listed & set(gone):
            break
    assert set(pids) <= listed
    assert not listed & set(gone), "the killed tenants are no longer listed"
    figures["comings_and_goings"] = {"reads_until_settled": reads, "listed": len(listed)}


@pytest.mark.skipif(not shutil.which("nvidia-cuda-mps-control"), reason="no MPS control daemon")
def test_mps_server_and_clients(tenants: Tenants, tmp_path: Path, figures: dict[str, Any]) -> None:
    """The server is listed with its own memory; clients in the compute and MPS lists; their
    work is sampled under the server's pid: clients' activity not known, never idle."""
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
    }
    full = {**os.environ, **env}
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=full, check=True)
    try:
        clients = {tenants.start(mib=256, busy=1.0, env=env), tenants.start(mib=256, env=env)}
        reader = agent(window=2)
        reads = list(cycles(reader, 8))
        gpu = _first_gpu(reads[-1])
        server = [p for p in gpu.processes if p.name == MPS_SERVER[:15] or p.name == MPS_SERVER]
        mine = {p.pid: p for p in gpu.processes if p.pid in clients}
        figures["mps"] = {
            "server_mib": [p.used_memory_mib for p in server],
            "clients": {str(p.pid): sorted(p.types) for p in mine.values()},
        }
        assert server, [p.name for p in gpu.processes]
        assert set(mine) == clients
        assert all("mps" in p.types for p in mine.values())
        assert all(p.activity_unknown and p.idle_since is None for p in mine.values())
    finally:
        tenants.close()  # the daemon's quit waits for its clients to be gone
        subprocess.run(
            ["nvidia-cuda-mps-control"], input="quit\n", text=True, env=full, timeout=60, check=True
        )


SHARE_MIB = 4096
"""Each share tenant's allocation, memset whole each time: about a millisecond and a half of the
engine's time a memset, so the launch and synchronisation between two (some microseconds) leave
the engine idle for a percent or two of a busy tenant's time, not the 15 % that 256 MiB would."""


def _anchor_scrapes(
    handle: Any, pids: dict[int, float], stop: threading.Event, every: float
) -> dict[float, list[float]]:
    """The anchors' method beside the agent: one read a scrape from one second back, each
    tenant's latest SM percentage (dcgm-exporter since its PR #594, HAMi-core)."""
    seen: dict[float, list[float]] = {duty: [] for duty in pids.values()}

    def scrape() -> None:
        while not stop.wait(every):
            since = int((time.time() - 1.0) * 1_000_000)
            try:
                found = {
                    s.pid: s.smUtil for s in pynvml.nvmlDeviceGetProcessUtilization(handle, since)
                }
            except pynvml.NVMLError_NotFound:
                found = {}
            for pid, duty in pids.items():
                seen[duty].append(found.get(pid, 0) / 100)

    threading.Thread(target=scrape, daemon=True).start()
    return seen


def _sampler_counts(handle: Any, pids: dict[int, float], stop: threading.Event) -> dict[str, Any]:
    """Reads at about the sampler's own rate (every 0.1 s, from the latest stamp seen): each
    tenant's samples, and every stamp, so the driver's own count stands beside the memsets."""
    counted: dict[str, Any] = {"stamps": [], "by_pid": {duty: [] for duty in pids.values()}}

    def count() -> None:
        cursor = int(time.time() * 1_000_000)
        while not stop.wait(0.1):
            try:
                samples = pynvml.nvmlDeviceGetProcessUtilization(handle, cursor)
            except pynvml.NVMLError_NotFound:
                continue
            for s in samples:
                if s.timeStamp > cursor and s.pid in pids:
                    counted["by_pid"][pids[s.pid]].append(s.timeStamp)
                counted["stamps"].append(s.timeStamp)
            cursor = max([cursor, *(s.timeStamp for s in samples)])

    threading.Thread(target=count, daemon=True).start()
    return counted


def test_the_published_share_is_the_physical_one(
    tenants: Tenants, tmp_path: Path, figures: dict[str, Any]
) -> None:
    """Three tenants at duties 1.0, 0.5 and 0.2, each doing the same memset of its allocation,
    first alone, then together for the agent's default window (5 minutes, the precision
    target's), read as the agent reads (its own wait between cycles: short reads every 2 s on
    average on its schedule; a cycle every 10 s).

    The busy tenant always has work, so the engine is never idle: each tenant's part of the
    memsets done together is its share of the engine's time. (Each one's memsets a second
    together over the busy one's alone add up to less: the time the engine spends switching
    between them does no tenant's work; the figures keep both.) The published share is within
    5 points of that part, and of the driver's own count (reads at the sampler's rate). Beside
    them, for the figures: the anchors' method, one read a 30 s scrape from one second back."""
    _driver(figures)
    duties = (1.0, 0.5, 0.2)
    alone: dict[float, float] = {}
    for duty in duties:
        count = tmp_path / f"alone-{duty}"
        pid = tenants.start(mib=SHARE_MIB, busy=duty, count=count)
        time.sleep(1.0)
        first = memsets(count)
        time.sleep(8.0)
        last = memsets(count)
        alone[duty] = (last[0] - first[0]) / (last[1] - first[1])
        Tenants.kill(pid)
    counts = {duty: tmp_path / f"together-{duty}" for duty in duties}
    pids = {tenants.start(mib=SHARE_MIB, busy=duty, count=counts[duty]): duty for duty in duties}
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    stop = threading.Event()
    anchor = _anchor_scrapes(handle, pids, stop, every=30.0)
    sampled = _sampler_counts(handle, pids, stop)
    window = DEFAULT_WINDOW.total_seconds()
    reader = agent(share_window=window)
    schedule = ShareSchedule(DEFAULT_READ_EVERY)  # the agent's default, on its schedule
    start = time.monotonic()
    read = reader.read()
    for cycle in range(1, int(window // 10) + 2):  # the agent's loop: wait, then a cycle
        wait_polling(reader, threading.Event(), start + 10 * cycle, shares=schedule)
        if cycle == 1:  # the start of the window the last cycle's shares cover
            marks = {duty: memsets(counts[duty]) for duty in duties}
            window_start = time.time()
        read = reader.read()
    ends = {duty: memsets(counts[duty]) for duty in duties}
    window_end = time.time()
    stop.set()
    rates = {
        duty: (ends[duty][0] - marks[duty][0]) / (ends[duty][1] - marks[duty][1]) for duty in duties
    }
    part = {duty: rate / sum(rates.values()) for duty, rate in rates.items()}
    published = _processes(read, set(pids))
    shares = {
        duty: published[pid].compute_share if pid in published else None
        for pid, duty in pids.items()
    }
    stamps = {t for t in sampled["stamps"] if window_start * 1e6 <= t <= window_end * 1e6}
    counted = {
        duty: sum(1 for t in at if window_start * 1e6 <= t <= window_end * 1e6) / len(stamps)
        for duty, at in sampled["by_pid"].items()
    }
    figures["share_memsets_per_s_alone"] = alone
    figures["share_together_over_alone"] = {d: r / alone[1.0] for d, r in rates.items()}
    figures["share_part_of_the_work"] = part
    figures["share_driver_count"] = counted
    figures["share_sampler_instants"] = (len(stamps), window_end - window_start)
    figures["share_published"] = shares
    figures["share_published_samples"] = {
        pids[pid]: (p.compute_share_samples, p.compute_share_seconds)
        for pid, p in published.items()
    }
    figures["share_anchor_scrapes"] = anchor
    for duty in duties:
        share = shares[duty]
        assert share is not None, f"duty {duty}: no share after the window"
        assert abs(share - counted[duty]) <= 0.05, ("the driver's count", duty, share, counted)
        assert abs(share - part[duty]) <= 0.05, ("the part of the work", duty, share, part)
