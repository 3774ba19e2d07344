"""The real GPU machine the suite runs on: whether there is one, CUDA tenants in cgroups laid
out as the kubelet lays them, and the agent reading real NVML."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from gpuusage_nodeagent.activity import ActivityTracker
from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.main import NodeReader
from gpuusage_nodeagent.report import AttributedReading
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.share import ShareTracker

REPO = Path(__file__).resolve().parents[2]
CGROUP_ROOT = Path("/sys/fs/cgroup")


def no_gpu_reason() -> str | None:
    """Why the suite cannot run here (None: a GPU, NVML and the CUDA driver are there)."""
    try:
        import pynvml  # noqa: PLC0415 - only where the suite runs

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() < 1:
                return "NVML sees no GPU"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no library, no driver: the reason is the message
        return f"no GPU here (NVML: {type(exc).__name__}: {exc})"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver library here ({exc})"
    return None


def cgroup_base() -> Path | None:
    """Where the suite can make cgroups: the v2 tree, or v1's pids hierarchy (every v1 line of
    /proc/<pid>/cgroup names a hierarchy's path; the resolver reads them all)."""
    if os.geteuid() != 0:
        return None
    base = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "pids"
    return base if os.access(base, os.W_OK) else None


@dataclass(frozen=True)
class Pod:
    """A pod as the kubelet lays out its container's cgroup."""

    uid: str = field(default_factory=lambda: str(uuidlib.uuid4()))
    container_id: str = field(default_factory=lambda: uuidlib.uuid4().hex + uuidlib.uuid4().hex)

    def cgroup(self, base: Path, driver: str) -> Path:
        """systemd driver: kubepods.slice/.../cri-containerd-<id>.scope; cgroupfs driver:
        kubepods/burstable/pod<uid>/<id>."""
        if driver == "systemd":
            pod = f"kubepods-burstable-pod{self.uid.replace('-', '_')}.slice"
            return (
                base
                / "kubepods.slice"
                / "kubepods-burstable.slice"
                / pod
                / f"cri-containerd-{self.container_id}.scope"
            )
        return base / "kubepods" / "burstable" / f"pod{self.uid}" / self.container_id


class Tenants:
    """CUDA tenants started for one test, all ended and their cgroups removed after it."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        self.cgroups: list[Path] = []  # the cgroups the tenants made, to remove after
        self.host_pid: dict[int, int] = {}  # Popen pid → the tenant's host pid

    def start(
        self,
        mib: int = 256,
        busy: float = 0.0,
        cgroup: Path | None = None,
        own_pid_namespace: bool = False,
        env: dict[str, str] | None = None,
        *,
        count: Path | None = None,
    ) -> int:
        """Start one tenant; its host pid once its memory is allocated. With `count`, it
        writes its memsets so far there (see tenant)."""
        return self._ready(self._launch(mib, busy, cgroup, own_pid_namespace, env, count=count))

    def start_many(self, count: int, mib: int, busy: float) -> list[int]:
        """Start `count` tenants side by side (one after another, 96 of them took minutes of
        interpreter and CUDA start-up); their host pids once each has its memory."""
        launched = [self._launch(mib, busy, None, False, None) for _ in range(count)]
        return [self._ready(one) for one in launched]

    def _launch(
        self,
        mib: int,
        busy: float,
        cgroup: Path | None,
        own_pid_namespace: bool,
        env: dict[str, str] | None,
        *,
        count: Path | None = None,
    ) -> tuple[subprocess.Popen[str], bool]:
        command = [sys.executable, "-m", "tests.gpu.tenant", "--mib", str(mib), "--busy", str(busy)]
        if count is not None:
            command += ["--count", str(count)]
        if cgroup is not None:
            command += ["--cgroup", str(cgroup)]
            made = [d for d in [cgroup, *cgroup.parents] if not d.exists()]
            self.cgroups += [d for d in made if d not in self.cgroups]
        if own_pid_namespace:
            command = ["unshare", "--pid", "--fork", "--mount-proc", *command]
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
        )
        self.processes.append(process)
        return process, own_pid_namespace

    def _ready(self, launched: tuple[subprocess.Popen[str], bool]) -> int:
        process, own_pid_namespace = launched
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"tenant did not start: {line!r}")
        pid = process.pid if not own_pid_namespace else _only_child(process.pid)
        self.host_pid[process.pid] = pid
        return pid

    @staticmethod
    def kill(host_pid: int) -> None:
        os.kill(host_pid, signal.SIGKILL)

    def close(self) -> None:
        for pid in self.host_pid.values():  # unshare's child outlives a killed unshare
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(timeout=30)
        for made in sorted(self.cgroups, key=lambda d: len(d.parts), reverse=True):
            for _ in range(50):  # a killed tenant leaves its cgroup a moment later
                try:
                    made.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.processes, self.cgroups, self.host_pid = [], [], {}  # a second close: nothing


def _only_child(pid: int) -> int:
    """The host pid of `unshare --fork`'s child (the tenant, pid 1 in its namespace)."""
    for _ in range(100):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise RuntimeError(f"unshare {pid} has no child")


def agent(window: float = 300.0, share_window: float = 300.0) -> NodeReader:
    """The agent's reader on real NVML and the host's /proc."""
    return NodeReader(
        "gpu-test-node",
        NvmlSource(),
        Resolver(Path("/proc")),
        activity=ActivityTracker(timedelta(seconds=window)),
        share=ShareTracker(timedelta(seconds=share_window)),
    )


def memsets(count: Path) -> tuple[int, float]:
    """What a tenant started with `count` has written: its memsets so far, and when."""
    done, at = count.read_text().split()
    return int(done), float(at)


def cycles(reader: NodeReader, seconds: float, every: float = 1.0) -> Iterator[AttributedReading]:
    """Agent cycles `every` seconds for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        yield reader.read()
        time.sleep(max(0.0, every - (time.monotonic() - started)))
