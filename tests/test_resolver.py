"""The pid resolver: its cache by pid and start time, what it keeps when files cannot be read,
reused pids, and the names it publishes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpuusage import procfs
from gpuusage_dev.proctree import write_process
from gpuusage_nodeagent.cgroup import CgroupAttribution
from gpuusage_nodeagent.main import own_kubelet_roots
from gpuusage_nodeagent.resolver import CLOCK_TICKS, Resolver, clean_name
from tests.examples import CTR_TRAIN, POD_TRAIN

CGROUP = (
    f"0::/kubepods.slice/kubepods-pod{POD_TRAIN.replace('-', '_')}.slice/"
    f"cri-containerd-{CTR_TRAIN}.scope\n"
)


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
