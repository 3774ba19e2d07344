"""Resolver cache, write rule, fake source and API error mapping."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes.client import exceptions
from kubernetes.client.exceptions import ApiException

from gpuusage import procfs
from gpuusage.api import names
from gpuusage.api.models import Gpu, GpuNodeUsageSpec, MigDevice, Source
from gpuusage.kube.errors import (
    ApiError,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    TooLarge,
    TransientApiError,
    from_status,
    retried,
)
from gpuusage.retry import Backoff, doubling
from gpuusage_dev.simulation import write_process
from gpuusage_nodeagent.cgroup import CgroupAttribution
from gpuusage_nodeagent.change import Decision, Fingerprint, decide, meaningful_change
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading
from gpuusage_nodeagent.gpusource.fake import FakeSource, ScenarioError
from gpuusage_nodeagent.main import NodeReader, own_kubelet_roots
from gpuusage_nodeagent.metrics import AgentMetrics, healthy
from gpuusage_nodeagent.publisher import Publisher
from gpuusage_nodeagent.report import AttributedReading, reading_pids
from gpuusage_nodeagent.resolver import CLOCK_TICKS, Resolved, Resolver, clean_name
from tests.examples import CTR_TRAIN, POD_TRAIN, example_spec
from tests.fakenvml import gpu_uuid

CGROUP = (
    f"0::/kubepods.slice/kubepods-pod{POD_TRAIN.replace('-', '_')}.slice/"
    f"cri-containerd-{CTR_TRAIN}.scope\n"
)
NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
BEAT = timedelta(seconds=60)


# -- resolver ----------------------------------------------------------------------------------
def test_the_agent_reads_paths_below_the_kubelet_root_its_own_cgroup_shows(tmp_path: Path) -> None:
    """A kubelet nested in an outer pod: the agent's own cgroup (proc-root/self/cgroup) gives
    the root, so a process of an inner pod is that pod's, not the outer pod's."""
    outer = "/kubepods/burstable/pod11111111-2222-4333-8444-555555555555/" + "a" * 64
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text(
        f"0::{outer}/kubepods/besteffort/pod99999999-2222-4333-8444-555555555555/{'b' * 64}\n"
    )
    write_process(tmp_path, 42, f"0::{outer}/kubepods/pod{POD_TRAIN}/{CTR_TRAIN}\n")
    found = Resolver(tmp_path, roots=own_kubelet_roots(tmp_path)).resolve(42)
    assert (found.attribution.container_id, found.attribution.pod_uid) == (CTR_TRAIN, POD_TRAIN)
    assert Resolver(tmp_path).resolve(42).attribution.container_id == "a" * 64


def test_resolver_caches_by_pid_and_start_time(tmp_path: Path) -> None:
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    resolver = Resolver(tmp_path)
    first = resolver.resolve(42)
    assert (first.attribution.container_id, first.attribution.pod_uid) == (CTR_TRAIN, POD_TRAIN)
    resolver.resolve(42)
    assert resolver.reads == 1, "a known (pid, start time) is not read again"
    # The pid is reused by a host process: a new start time means a new process.
    write_process(tmp_path, 42, "0::/system.slice/sshd.service", comm="sshd", start_ticks=900)
    reused = resolver.resolve(42)
    assert reused.attribution.container_id is None
    assert reused.comm == "sshd"
    assert resolver.reads == 2


def test_resolver_reads_start_times_only_when_the_stat_file_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    resolver = Resolver(tmp_path)
    calls: list[int] = []
    real = procfs.start_ticks

    def counted(pid: int, root: Path) -> int | None:
        calls.append(pid)
        return real(pid, root)

    monkeypatch.setattr(procfs, "start_ticks", counted)
    resolver.resolve(42)
    resolver.end_cycle()
    assert (resolver.resolve(42).attribution.pod_uid, len(calls)) == (POD_TRAIN, 2), (
        "first cycle: start time read (and re-checked after the cgroup read); second: stat only"
    )
    # procfs dropped and re-created the inode of the same process: read again, same process.
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    assert resolver.resolve(42).attribution.pod_uid == POD_TRAIN
    assert (len(calls), resolver.reads) == (3, 1)


def test_resolver_forgets_processes_not_seen_in_a_cycle(tmp_path: Path) -> None:
    for pid in (1, 2, 3):
        write_process(tmp_path, pid, CGROUP, start_ticks=pid)
    resolver = Resolver(tmp_path)
    for pid in (1, 2, 3):
        resolver.resolve(pid)
    resolver.end_cycle()
    assert len(resolver) == 3
    resolver.resolve(2)
    resolver.end_cycle()
    assert len(resolver) == 1


def test_vanished_pid_is_reported_not_raised(tmp_path: Path) -> None:
    found = Resolver(tmp_path).resolve(31337)
    assert found.error is not None
    assert "not found under" in found.error
    assert "hostPID" in found.error


def _unreadable(path: Path) -> None:
    if not path.is_dir():
        path.unlink()
        path.mkdir()  # unreadable even for root: EISDIR


def _break_cgroup(root: Path, pid: int) -> None:
    _unreadable(root / str(pid) / "cgroup")


def _break_stat(root: Path, pid: int) -> None:
    _unreadable(root / str(pid) / "stat")


def _hide(root: Path, pid: int) -> None:
    if (root / str(pid)).exists():  # as hidepid= or a lost hostPID shows it
        (root / str(pid)).rename(root / f".hidden-{pid}")


def _unparseable(root: Path, pid: int) -> None:
    (root / str(pid) / "cgroup").write_text("\x00garbage\n")


def _stat_then(cgroup_fault: Callable[[Path, int], None]) -> Callable[[Path, int], None]:
    """The stat file unreadable for a cycle (the cache forgets the process), then readable
    again with its cgroup file broken: the cgroup file is read, and fails."""

    def fault(root: Path, pid: int) -> None:
        if (root / str(pid) / "stat").is_dir():
            (root / str(pid) / "stat").rmdir()
            write_process(root, pid, CGROUP, start_ticks=500)
            cgroup_fault(root, pid)
        else:
            _break_stat(root, pid)

    return fault


@pytest.mark.parametrize(
    "fault", [_break_stat, _hide, _stat_then(_break_cgroup), _stat_then(_unparseable)]
)
def test_could_not_read_keeps_the_last_attribution_for_the_grace_period(
    tmp_path: Path, fault: Callable[[Path, int], None]
) -> None:
    """A process the GPU library still lists is not taken for ended because its /proc files
    cannot be read: its pod stays for `grace`, then is given up with the reason, never dropped
    silently."""
    clock = [1000.0]
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    resolver = Resolver(tmp_path, grace=120, clock=lambda: clock[0])
    assert resolver.resolve(42).attribution.pod_uid == POD_TRAIN
    resolver.end_cycle()
    fault(tmp_path, 42)
    within = resolver.resolve(42)
    assert (within.attribution.container_id, within.attribution.pod_uid) == (CTR_TRAIN, POD_TRAIN)
    assert within.error is not None
    assert within.error.endswith("showing the attribution last read")
    resolver.end_cycle()
    clock[0] += 120
    fault(tmp_path, 42)  # (a second step for the faults that take two)
    again = resolver.resolve(42)
    assert again.attribution == within.attribution
    assert again.error is not None
    assert again.error.endswith("showing the attribution last read")
    assert resolver.resolve(42) == again, "the same text every cycle: no write of its own"
    resolver.end_cycle()
    clock[0] += 1
    expired = resolver.resolve(42)
    assert expired.attribution == CgroupAttribution()
    assert expired.error is not None
    assert f"for more than 120s; last known pod {POD_TRAIN}" in expired.error
    resolver.end_cycle()
    # Readable again: a fresh attribution, and a later failure gets a new grace period.
    if (tmp_path / ".hidden-42").exists():
        (tmp_path / ".hidden-42").rename(tmp_path / "42")
    for name in ("stat", "cgroup"):
        if (tmp_path / "42" / name).is_dir():
            (tmp_path / "42" / name).rmdir()
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    assert resolver.resolve(42).error is None
    resolver.end_cycle()
    fault(tmp_path, 42)
    assert resolver.resolve(42).attribution.pod_uid == POD_TRAIN


def test_a_reused_pid_never_inherits_the_last_attribution(tmp_path: Path) -> None:
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    resolver = Resolver(tmp_path, grace=120, clock=lambda: 0.0)
    assert resolver.resolve(42).attribution.pod_uid == POD_TRAIN
    resolver.end_cycle()
    write_process(tmp_path, 42, CGROUP, start_ticks=900)  # another process, same pid
    _break_cgroup(tmp_path, 42)
    other = resolver.resolve(42)
    assert other.attribution == CgroupAttribution()
    assert other.error is not None
    assert "cannot read" in other.error
    # And a process that leaves the GPUs is forgotten: back under its pid, it starts afresh.
    resolver.end_cycle()
    resolver.end_cycle()
    _hide(tmp_path, 42)
    assert resolver.resolve(42).attribution == CgroupAttribution()


def test_a_pid_nvml_lists_from_an_exited_process_does_not_charge_its_new_owner(
    tmp_path: Path,
) -> None:
    """NVML has listed pid 42 since second 200 after boot; its process exits, and at second
    300 another pod's process gets 42 while NVML still lists it: the memory is not the new
    process's, so 42 is unresolved (use unknown), never attributed to the new pod. Once NVML
    stops listing it, a later listing of 42 is the new process's."""
    tick = CLOCK_TICKS
    (tmp_path / "uptime").write_text("200.00 100.00\n")
    write_process(tmp_path, 42, CGROUP, start_ticks=150 * tick)
    resolver = Resolver(tmp_path)
    assert resolver.resolve(42).attribution.pod_uid == POD_TRAIN
    resolver.end_cycle()
    other = f"0::/kubepods/pod{'9' * 8}-1111-4222-8333-444444444444/{'e' * 64}\n"
    write_process(tmp_path, 42, other, start_ticks=300 * tick)
    (tmp_path / "uptime").write_text("310.00 100.00\n")
    found = resolver.resolve(42)
    assert found.attribution == CgroupAttribution()
    assert found.error is not None
    assert "pid 42 was reused" in found.error
    resolver.end_cycle()
    again = resolver.resolve(42)  # the next cycle, nothing changed: never the old answer
    assert again.error is not None
    assert "pid 42 was reused" in again.error
    resolver.end_cycle()
    resolver.end_cycle()  # not listed for a cycle: the next listing is a new one
    assert resolver.resolve(42).attribution.container_id == "e" * 64
    # Without the proc root's uptime nothing is judged (a tree without one, as in tests).
    (tmp_path / "uptime").unlink()
    assert Resolver(tmp_path).resolve(42).attribution.container_id == "e" * 64


def test_the_boot_clock_is_read_once_per_newly_listed_pid(tmp_path: Path) -> None:
    """Every cycle resolves every listed pid: the uptime is read only when a pid appears."""
    write_process(tmp_path, 42, CGROUP, start_ticks=500)
    reads: list[int] = []

    def uptime() -> float:
        reads.append(1)
        return 1000.0

    resolver = Resolver(tmp_path, boot_clock=uptime)
    for _ in range(3):
        assert resolver.resolve(42).attribution.pod_uid == POD_TRAIN
        resolver.end_cycle()
    assert len(reads) == 1


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        (b"/usr/bin/python3.11", "python3.11"),
        ("/opt/conda/bin/python train.py --api-key=XYZ", "python"),
        ("tritonserver\0--model-repository=/models", "tritonserver"),
        ("", None),
        (None, None),
        ("x" * 100, "x" * 64),
    ],
)
def test_clean_name_never_leaks_arguments(raw: str | bytes | None, name: str | None) -> None:
    assert clean_name(raw) == name


# -- the write rule ----------------------------------------------------------------------------
def _with_memory(delta: int, pid_index: int = 0) -> GpuNodeUsageSpec:
    spec = example_spec("n", NOW)
    gpu = spec.gpus[0]
    procs = list(gpu.processes)
    old = procs[pid_index]
    procs[pid_index] = old.model_copy(
        update={"used_memory_mib": (old.used_memory_mib or 0) + delta}
    )
    gpus = [gpu.model_copy(update={"processes": procs}), *spec.gpus[1:]]
    return spec.model_copy(update={"gpus": gpus})


def attributed_from(spec: GpuNodeUsageSpec) -> AttributedReading:
    """The reading and resolver answers that publish `spec` (every other name left to the
    resolver's comm, so both ways of naming a process are covered)."""
    raw: dict[str, list[RawProcess]] = {}
    found: dict[int, Resolved] = {}
    devices: list[Gpu | MigDevice] = [*spec.gpus, *(m for g in spec.gpus for m in g.mig_devices)]
    for device in devices:
        assert device.uuid is not None
        raw[device.uuid] = []
        for i, p in enumerate(device.processes):
            name = None if i % 2 else p.name
            raw[device.uuid].append(
                RawProcess(
                    p.pid,
                    name,
                    p.used_memory_mib,
                    tuple(p.types),
                    p.sm_util_percent,
                    p.memory_util_percent,
                    None if p.activity_unknown else True,
                )
            )
            found[p.pid] = Resolved(CgroupAttribution(p.container_id, p.pod_uid), p.name)
    bare = [
        g.model_copy(
            update={
                "processes": [],
                "mig_devices": [m.model_copy(update={"processes": []}) for m in g.mig_devices],
            }
        )
        for g in spec.gpus
    ]
    source = spec.source or Source(kind="fake", available=True)
    return AttributedReading(
        spec.node_name, spec.observed_at, Reading(source, bare, processes=raw), found
    )


def fingerprint(spec: GpuNodeUsageSpec) -> Fingerprint:
    built = attributed_from(spec)
    assert built.spec().to_api()["gpus"] == spec.to_api()["gpus"], "the reading publishes spec"
    return built.fingerprint()


def test_jitter_below_threshold_is_not_a_change() -> None:
    base = example_spec("n", NOW)
    later = example_spec("n", NOW + timedelta(seconds=10))
    fp = fingerprint(base)
    assert not meaningful_change(fp, fingerprint(later), 64), "observedAt alone is no change"
    assert not meaningful_change(fp, fingerprint(_with_memory(63)), 64)
    assert not meaningful_change(fp, fingerprint(_with_memory(-40)), 64)
    assert meaningful_change(fp, fingerprint(_with_memory(64)), 64)


def test_new_process_or_attribution_is_a_change() -> None:
    base = example_spec("n", NOW)
    gpu = base.gpus[0]
    fewer = base.model_copy(
        update={"gpus": [gpu.model_copy(update={"processes": gpu.processes[1:]}), base.gpus[1]]}
    )
    assert meaningful_change(fingerprint(base), fingerprint(fewer), 64)
    moved = gpu.processes[0].model_copy(update={"pod_uid": None})
    changed = base.model_copy(
        update={
            "gpus": [
                gpu.model_copy(update={"processes": [moved, *gpu.processes[1:]]}),
                base.gpus[1],
            ]
        }
    )
    assert meaningful_change(fingerprint(base), fingerprint(changed), 64)


def test_decide_writes_first_on_change_and_on_heartbeat() -> None:
    base = fingerprint(example_spec("n", NOW))
    assert decide(None, None, base, NOW, heartbeat=BEAT, threshold_mib=64).reason == "first report"
    same = fingerprint(example_spec("n", NOW + timedelta(seconds=30)))
    quiet = decide(base, NOW, same, NOW + timedelta(seconds=30), heartbeat=BEAT, threshold_mib=64)
    assert not quiet.write
    beat = decide(base, NOW, same, NOW + BEAT, heartbeat=BEAT, threshold_mib=64)
    assert (beat.write, beat.reason) == (True, "heartbeat")
    grown = fingerprint(_with_memory(500))
    changed = decide(base, NOW, grown, NOW + timedelta(seconds=1), heartbeat=BEAT, threshold_mib=64)
    assert (changed.write, changed.reason) == (True, "changed")


def test_slow_drift_is_published_once_it_adds_up() -> None:
    """Compared with the last *published* report, 10 steps of 10 MiB do trigger a write."""
    published = fingerprint(example_spec("n", NOW))
    writes = 0
    for step in range(1, 11):
        drifted = fingerprint(_with_memory(10 * step))
        if decide(published, NOW, drifted, NOW, heartbeat=BEAT, threshold_mib=64).write:
            writes += 1
            published = drifted
    assert writes == 1


# -- fake source -------------------------------------------------------------------------------
def _scenario(path: Path, used: int) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "gpus": [
                    {
                        "index": 0,
                        "uuid": gpu_uuid(0),
                        "memoryTotalMiB": 1000,
                        "processes": [{"pid": 5, "usedMemoryMiB": used}],
                    }
                ]
            }
        )
    )


def _first_process(reading: Reading) -> RawProcess:
    return reading.processes_of(reading.gpus[0])[0]


def test_fake_source_follows_edits_and_keeps_the_last_good_scenario(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    _scenario(path, 100)
    source = FakeSource(path)
    assert _first_process(source.read()).used_memory_mib == 100
    _scenario(path, 300)
    assert _first_process(source.read()).used_memory_mib == 300
    path.write_text("gpus: [ {index: 0, uuid: nope")  # a half-saved edit
    reading = source.read()
    assert _first_process(reading).used_memory_mib == 300
    assert reading.source.message is not None
    assert "not valid YAML" in reading.source.message
    assert reading.errors["ScenarioInvalid"] == 1


def test_fake_source_rejects_a_bad_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"gpus": [{"index": 0, "uuid": gpu_uuid(0)}]}))
    with pytest.raises(ScenarioError, match=r"gpus\.0\.memoryTotalMiB: Field required"):
        FakeSource(path)
    with pytest.raises(ScenarioError, match="cannot read GPU scenario"):
        FakeSource(tmp_path / "missing.yaml")


def test_fake_source_injects_nvml_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "gpus": [
                    {"index": 0, "uuid": gpu_uuid(0), "memoryTotalMiB": 10, "error": "GpuIsLost"},
                    {
                        "index": 1,
                        "uuid": gpu_uuid(1),
                        "memoryTotalMiB": 10,
                        "processesError": "NoPermission",
                        "processes": [{"pid": 9}],
                    },
                    {
                        "index": 2,
                        "uuid": gpu_uuid(2),
                        "memoryTotalMiB": 10,
                        "processes": [{"pid": 8}],
                    },
                ]
            }
        )
    )
    reading = FakeSource(path).read()
    gpus = reading.gpus
    assert gpus[0].error is not None
    assert gpus[0].error.reason == "GpuIsLost"
    assert gpus[1].error is not None
    assert gpus[1].error.reason == "NoPermission"
    assert reading.processes_of(gpus[1]) == ()
    assert [p.pid for p in reading.processes_of(gpus[2])] == [8]
    path.write_text(yaml.safe_dump({"nvmlError": "DriverNotLoaded"}))
    reading = FakeSource(path).read()
    assert reading.source.available is False
    assert reading.gpus == []


# -- API errors --------------------------------------------------------------------------------
def _api_exception(status: int, message: str = "boom") -> ApiException:
    exc = ApiException(status=status, reason="R")
    exc.body = f'{{"kind":"Status","message":"{message}","reason":"X"}}'
    return exc


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (404, NotFound),
        (409, Conflict),
        (403, Forbidden),
        (422, Invalid),
        (500, TransientApiError),
        (503, TransientApiError),
        (429, TransientApiError),
    ],
)
def test_errors_map_to_our_hierarchy(status: int, kind: type[Exception]) -> None:
    def fail() -> None:
        raise _api_exception(status, "the server said so")

    with pytest.raises(kind, match="the server said so"):
        retried(fail, "test", backoff=Backoff((0.0,)), sleep=lambda _: None)


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (exceptions.NotFoundException, NotFound),
        (exceptions.ConflictException, Conflict),
        (exceptions.ForbiddenException, Forbidden),
        (exceptions.UnprocessableEntityException, Invalid),
        (exceptions.ServiceException, TransientApiError),
    ],
)
def test_the_clients_own_subclasses_map_to_our_hierarchy_too(
    raised: type[ApiException], kind: type[ApiError]
) -> None:
    """The client raises NotFoundException and friends, not ApiException itself: a 404 that
    escapes `except NotFound` would count a deleted pod as an API failure."""
    status = {NotFound: 404, Conflict: 409, Forbidden: 403, Invalid: 422}.get(kind, 503)

    def fail() -> None:
        exc = raised(status=status, reason="R")
        exc.body = '{"kind":"Status","message":"the server said so","reason":"X"}'
        raise exc

    with pytest.raises(kind, match="the server said so"):
        retried(fail, "test", backoff=Backoff((0.0,)), sleep=lambda _: None)


def test_transient_errors_are_retried_with_bounded_backoff() -> None:
    attempts: list[int] = []
    sleeps: list[float] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]
        return "ok"

    assert retried(flaky, "test", backoff=Backoff((1.0, 2.0, 4.0)), sleep=sleeps.append) == "ok"
    assert len(attempts) == 3
    assert 0.5 <= sleeps[0] <= 1.0, "jittered below the step"
    assert 1.0 <= sleeps[1] <= 2.0

    def down() -> None:
        raise _api_exception(503)

    sleeps.clear()
    with pytest.raises(TransientApiError):
        retried(down, "test", backoff=Backoff((1.0, 2.0)), sleep=sleeps.append)
    assert len(sleeps) == 2, "bounded: no endless retry"


def test_permanent_errors_are_not_retried() -> None:
    sleeps: list[float] = []

    def forbidden() -> None:
        raise _api_exception(403)

    with pytest.raises(Forbidden):
        retried(forbidden, "test", backoff=Backoff((1.0, 2.0)), sleep=sleeps.append)
    assert sleeps == []


def test_health_follows_completed_cycles() -> None:
    assert healthy(None, 1000.0, 10.0) == (True, "starting")
    assert healthy(990.0, 1000.0, 10.0)[0]
    assert healthy(940.0, 1000.0, 10.0)[0], "3 intervals + 30 s grace = 60 s"
    ok, text = healthy(939.0, 1000.0, 10.0)
    assert not ok
    assert text == "no cycle completed for 61.0s (interval 10s)"


def test_the_spec_is_built_once_and_the_fingerprint_sees_every_attribution() -> None:
    """The write rule compares a reading's fingerprint and builds the spec only to write it."""
    spec = example_spec("gpu-node-a", NOW)  # GPUs, a MIG device, named and unnamed processes
    attributed = attributed_from(spec)
    reading, found = attributed.reading, dict(attributed.found)
    pids = sorted(reading_pids(reading))
    found[pids[1]] = Resolved(CgroupAttribution(), None, f"pid {pids[1]} exited")
    observed = AttributedReading("gpu-node-a", NOW, reading, found)
    built = observed.spec()
    assert observed.spec() is built, "built once"
    assert observed.unresolved() == 1
    assert [p.resolve_error for g in built.gpus for p in g.processes if p.pid == pids[1]] == [
        f"pid {pids[1]} exited"
    ]
    before = observed.fingerprint()
    assert before != attributed.fingerprint(), "a resolve error is a change"
    for pid, change in (
        (pids[0], Resolved(CgroupAttribution("f" * 64, POD_TRAIN), "trainer")),
        (pids[2], Resolved(CgroupAttribution(None, None), "python3")),
    ):
        moved = AttributedReading("gpu-node-a", NOW, reading, {**found, pid: change})
        assert moved.fingerprint() != before
    later = AttributedReading("gpu-node-a", NOW + timedelta(seconds=9), reading, found)
    assert later.fingerprint() == before, "the time of the reading is no change"


def _gpu(index: int, **fields: Any) -> dict[str, Any]:
    return {"index": index, "uuid": gpu_uuid(index), "memoryTotalMiB": 9, **fields}


def _gpus(*gpus: dict[str, Any]) -> bytes:
    return yaml.safe_dump({"gpus": list(gpus)}).encode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"gpus:\n  - name: caf\xe9\n", "is not UTF-8 text (byte 19"),
        (b"", "is empty; a node without GPUs is written `gpus: []`"),
        (b"# nothing but a comment\n", "is empty"),
        (b"- a list\n", "must be a mapping with `gpus:`, not list"),
        (_gpus(_gpu(0, name="x" * 97)), "gpus.0.name: String should have at most 96 characters"),
        (yaml.safe_dump({"driverVersion": "5" * 65}).encode(), "driverVersion: String should"),
        (_gpus(_gpu(0, processes=[{"pid": 7}, {"pid": 7}])), "listed more than once: 7"),
        (_gpus(_gpu(0), _gpu(1, uuid=gpu_uuid(0))), "device UUID listed more than once: GPU-"),
        (_gpus(_gpu(0), _gpu(0, uuid=gpu_uuid(1))), "GPU index listed more than once: 0"),
    ],
)
def test_every_invalid_scenario_is_refused_with_a_message_and_the_last_valid_one_kept(
    tmp_path: Path, content: bytes, message: str
) -> None:
    """At start: a clear error. While running: the last valid scenario, and the reason said in
    the published source, so a bad edit never ends a pod's use or counts a process twice."""
    path = tmp_path / "s.yaml"
    path.write_bytes(content)
    with pytest.raises(ScenarioError, match=re.escape(message)):
        FakeSource(path)
    _scenario(path, 100)
    source = FakeSource(path)
    path.write_bytes(content)
    reading = source.read()
    assert _first_process(reading).used_memory_mib == 100, "the last valid scenario is kept"
    assert reading.source.message is not None
    assert message in reading.source.message
    assert reading.source.message.endswith("showing the last valid scenario")
    assert reading.errors["ScenarioInvalid"] == 1


# -- bodies refused for good -------------------------------------------------------------------
@dataclass
class Publishing:
    """A publisher fed by a reader of a scenario file, on a clock the test moves."""

    publisher: Publisher
    reader: NodeReader
    now: list[datetime]
    metrics: AgentMetrics

    def offer_at(self, seconds: float) -> Decision:
        self.now[0] = NOW + timedelta(seconds=seconds)
        return self.publisher.offer(self.reader.read())


def _publishing(tmp_path: Path, api: Any, **options: Any) -> Publishing:
    """Publishing for `api` of a scenario with one 100 MiB process (see _scenario)."""
    path = tmp_path / "s.yaml"
    _scenario(path, 100)
    metrics = AgentMetrics()
    publisher = Publisher(api, "n1", heartbeat=BEAT, threshold_mib=64, metrics=metrics, **options)
    now = [NOW]
    reader = NodeReader("n1", FakeSource(path), Resolver(tmp_path), clock=lambda: now[0])
    return Publishing(publisher, reader, now, metrics)


class RefusingApi:
    """The agent's REST client against an API that refuses any report listing processes, as
    etcd refuses a request over its limit."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.refused = 0

    def post(self, path: str, body: Any) -> dict[str, Any]:
        return {}  # no SelfSubjectReview answer: the Node is read instead

    def get(self, path: str) -> dict[str, Any]:
        return {"metadata": {"uid": "node-uid"}}

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        listed = [p for g in body["spec"].get("gpus", []) for p in g.get("processes", [])]
        if listed:
            self.refused += 1
            raise from_status(500, '{"message":"etcdserver: request is too large"}')
        self.bodies.append(body)
        return {}


def test_a_body_refused_for_good_is_never_sent_again_and_the_refusal_is_published(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = RefusingApi()
    publishing = _publishing(tmp_path, api)
    metrics = publishing.metrics
    for later in (0, 1, 60):  # the same observation: first write, unchanged, heartbeat
        publishing.offer_at(later)
    assert api.refused == 1, "the refused body was sent once, not retried, not re-sent"
    assert len(api.bodies) == 2, "the report without processes, then its heartbeat"
    assert api.bodies[-1] == {"spec": {"observedAt": "2026-11-21T12:01:00Z"}}, (
        "the heartbeat refreshes observedAt alone: the stored report stays the one without"
    )
    spec = api.bodies[0]["spec"]
    assert "the API refused this node's full report" in spec["source"]["message"]
    assert "request is too large" in spec["source"]["message"]
    assert spec["gpus"][0]["error"]["reason"] == "ReportRefused"
    failures = metrics.registry.get_sample_value(
        "gpuusage_agent_api_failures_total", {"kind": "TooLarge"}
    )
    assert failures == 1
    assert metrics.registry.get_sample_value("gpuusage_agent_writes_skipped_total") == 1
    assert sum("refused the report" in r.getMessage() for r in caplog.records) == 1
    # The observation changes: the full report is tried again (and refused again, once).
    _scenario(tmp_path / "s.yaml", 900)
    publishing.offer_at(3 * BEAT.total_seconds())
    assert api.refused == 2


def test_etcds_and_the_apiservers_size_refusals_are_permanent() -> None:
    assert isinstance(from_status(500, '{"message":"etcdserver: request is too large"}'), TooLarge)
    assert isinstance(from_status(413, "{}"), TooLarge)
    assert isinstance(
        from_status(500, '{"message":"etcdserver: leader changed"}'), TransientApiError
    )
    attempts: list[int] = []

    def refused() -> None:
        attempts.append(1)
        raise from_status(413, '{"message":"Request entity too large"}')

    with pytest.raises(TooLarge):
        retried(refused, "test", backoff=Backoff((0.0, 0.0)), sleep=lambda _: None)
    assert attempts == [1], "not retried"


def test_backoffs_give_up_after_their_steps_or_go_on_forever_capped() -> None:
    bounded = Backoff((1.0, 2.0), jitter=0.0)
    assert (list(bounded), bounded.attempts) == ([1.0, 2.0], 3)
    forever = doubling(1.0, 5.0)
    assert forever.attempts is None
    first = list(itertools.islice(iter(forever), 6))
    assert all(a <= b for a, b in zip([0.5, 1.0, 2.0, 2.5, 2.5, 2.5], first, strict=True))
    assert all(b <= a for a, b in zip([1.0, 2.0, 4.0, 5.0, 5.0, 5.0], first, strict=True))


class RecordingApi:
    """Takes every write as the apiserver would, and keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def post(self, path: str, body: Any) -> dict[str, Any]:
        return {}  # no SelfSubjectReview answer: the Node is read instead

    def get(self, path: str) -> dict[str, Any]:
        return {"metadata": {"uid": "node-uid"}}

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        self.bodies.append(body)
        return {}


def test_refreshes_restate_the_published_content_never_the_jitter(tmp_path: Path) -> None:
    """An unchanged report is refreshed with observedAt alone, and every sixth time with the
    whole spec as it was published (undoing anyone else's edit), never with the few MiB the
    memory moved since: the operator has nothing to rewrite on the pods."""
    path = tmp_path / "s.yaml"
    _scenario(path, 100)
    api = RecordingApi()
    publisher = Publisher(api, "n1", heartbeat=BEAT, threshold_mib=64, metrics=AgentMetrics())  # type: ignore[arg-type]
    now = [NOW]
    reader = NodeReader("n1", FakeSource(path), Resolver(tmp_path), clock=lambda: now[0])
    publisher.offer(reader.read())
    for n in range(1, 13):
        _scenario(path, 100 + n)  # jitter, below the threshold
        now[0] = NOW + n * BEAT
        publisher.offer(reader.read())
    refreshes = api.bodies[1:]
    assert len(refreshes) == 12
    whole = [n for n, body in enumerate(refreshes, start=1) if "gpus" in body["spec"]]
    assert whole == [6, 12]
    assert refreshes[0] == {"spec": {"observedAt": "2026-11-21T12:01:00Z"}}
    used = refreshes[5]["spec"]["gpus"][0]["processes"][0]["usedMemoryMiB"]
    assert used == 100, "the published value, not the jittered 106"
    assert refreshes[5]["spec"]["observedAt"] == "2026-11-21T12:06:00Z"


class JudgingApi(RecordingApi):
    """Answers each write with the report as stored, its status saying how the operator
    judges the node (the Stale condition's reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        super().merge_patch(path, body)
        if self.reason is None:
            return {"metadata": {"name": "n1"}, "spec": {}}
        stale = {"type": "Stale", "status": "False", "reason": self.reason}
        return {"metadata": {"name": "n1"}, "status": {"conditions": [stale]}}


def test_an_unchanged_report_is_refreshed_rarely_only_once_the_lease_is_what_counts(
    tmp_path: Path,
) -> None:
    """An agent with a Lease keeps refreshing every heartbeat until the report's status says
    the operator judges the node by the Lease: under an operator of an earlier version (no
    status of that kind) a rare refresh would turn a live node stale."""
    path = tmp_path / "s.yaml"
    _scenario(path, 100)
    api = JudgingApi()
    publisher = Publisher(
        api,  # type: ignore[arg-type]
        "n1",
        heartbeat=BEAT,
        threshold_mib=64,
        metrics=AgentMetrics(),
        lease_refresh=5 * BEAT,
    )
    now = [NOW]
    reader = NodeReader("n1", FakeSource(path), Resolver(tmp_path), clock=lambda: now[0])

    def minutes(start: int, end: int) -> int:
        """Offer a reading every 10 s over these minutes; the writes made."""
        before = len(api.bodies)
        for tick in range(start * 6, end * 6):
            now[0] = NOW + tick * BEAT / 6
            publisher.offer(reader.read())
        return len(api.bodies) - before

    assert minutes(0, 10) == 10, "no status: the first write, then every heartbeat"
    api.reason = "ReportFresh"  # an operator that does not read the Lease
    assert minutes(10, 20) == 10
    api.reason = names.STALE_REASON_LEASE
    assert minutes(20, 21) == 1, "the answer that says so"
    assert publisher.refresh_every == 5 * BEAT
    assert minutes(21, 41) == 4, "every five minutes"
    api.reason = "ReportFresh"  # the operator lost the Lease: seen at the next refresh
    assert minutes(41, 51) == 6, "one more five-minute refresh, then every heartbeat"
    assert publisher.refresh_every == BEAT


class PolicyRefusingApi(RefusingApi):
    """An API whose admission policy refuses reports listing processes (422) until fixed."""

    fixed = False

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        listed = [p for g in body["spec"].get("gpus", []) for p in g.get("processes", [])]
        if listed and not self.fixed:
            self.refused += 1
            raise from_status(422, '{"message":"ValidatingAdmissionPolicy denied request"}')
        self.bodies.append(body)
        return {}


def test_a_body_a_policy_refused_is_tried_again_a_refresh_later(tmp_path: Path) -> None:
    """A refusal by validation may not last (the policy or webhook gets fixed): the full
    report is tried again one refresh after the refusal, not every cycle."""
    api = PolicyRefusingApi()
    publishing = _publishing(tmp_path, api)
    publishing.offer_at(0)
    publishing.offer_at(30)
    assert (api.refused, publishing.publisher.current) == (1, True), "the refusal is published"
    api.fixed = True
    publishing.offer_at(BEAT.total_seconds())
    assert api.refused == 1
    assert api.bodies[-1]["spec"]["gpus"][0]["processes"], "the full report, a refresh later"
    assert "refused" not in (api.bodies[-1]["spec"]["source"].get("message") or "")
