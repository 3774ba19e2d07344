"""Idle processes, agent side: the tracker's transitions, and that only they reach a report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from gpuusage_nodeagent.activity import ActivityTracker
from gpuusage_nodeagent.change import meaningful_change
from gpuusage_nodeagent.gpusource.fake import FakeSource
from gpuusage_nodeagent.main import NodeReader
from gpuusage_nodeagent.resolver import Resolver
from tests.fakenvml import gpu_uuid, mig_uuid

T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)
KEY = (gpu_uuid(0), 42)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_idle_once_quiet_for_the_whole_window_since_the_quiet_began() -> None:
    tracker = ActivityTracker(WINDOW)
    assert tracker.idle_since(KEY, True, _at(0)) is None
    assert tracker.idle_since(KEY, False, _at(10)) is None
    assert tracker.idle_since(KEY, False, _at(309)) is None, "not yet the whole window"
    assert tracker.idle_since(KEY, False, _at(310)) == _at(10)
    assert tracker.idle_since(KEY, False, _at(900)) == _at(10), "the same time, cycle after cycle"
    assert tracker.idle_since(KEY, True, _at(910)) is None, "active again at once"
    assert tracker.idle_since(KEY, False, _at(920)) is None, "the quiet starts over"
    assert tracker.idle_since(KEY, False, _at(1220)) == _at(920)


def test_unknown_is_never_idle_and_starts_the_quiet_over() -> None:
    tracker = ActivityTracker(WINDOW)
    tracker.idle_since(KEY, False, _at(0))
    assert tracker.idle_since(KEY, None, _at(400)) is None
    assert tracker.idle_since(KEY, False, _at(410)) is None
    assert tracker.idle_since(KEY, False, _at(710)) == _at(410)
    for later in range(0, 3600, 60):
        assert tracker.idle_since((mig_uuid(0), 7), None, _at(later)) is None


def test_a_process_gone_is_forgotten() -> None:
    tracker = ActivityTracker(WINDOW)
    tracker.idle_since(KEY, False, _at(0))
    tracker.forget_except([])
    assert tracker.idle_since(KEY, False, _at(400)) is None, "a new process under an old pid"


def _scenario(path: Path, sm: dict[int, int | None]) -> None:
    processes: list[dict[str, Any]] = []
    for pid, util in sm.items():
        entry: dict[str, Any] = {"pid": pid, "usedMemoryMiB": 70_000 if pid == 5 else 1000}
        if util is not None:
            entry["smUtil"] = util
        processes.append(entry)
    gpu = {"index": 0, "uuid": gpu_uuid(0), "memoryTotalMiB": 81920, "processes": processes}
    path.write_text(yaml.safe_dump({"gpus": [gpu]}))


def test_only_the_transitions_change_the_report(tmp_path: Path) -> None:
    """A notebook (pid 5) goes quiet; a trainer (pid 6) computes at a changing rate; pid 7 is
    on a GPU that does not tell. Percentages alone never change what the write rule compares;
    becoming idle and active again does, once each."""
    path = tmp_path / "s.yaml"
    _scenario(path, {})
    now = [T0]
    reader = NodeReader(
        "n1",
        FakeSource(path),
        Resolver(tmp_path),
        clock=lambda: now[0],
        activity=ActivityTracker(WINDOW),
    )

    def cycle(seconds: float, sm: dict[int, int | None]) -> Any:
        now[0] = _at(seconds)
        _scenario(path, sm)
        return reader.read()

    first = cycle(0, {5: 80, 6: 30, 7: None})
    changes = []
    last = first.fingerprint()
    for t in range(10, 900, 10):
        read = cycle(t, {5: 0, 6: 30 + t % 60, 7: None})
        fp = read.fingerprint()
        if meaningful_change(last, fp, 64):
            changes.append(t)
        last = fp
    assert changes == [310], "one change: the notebook became idle after the window"
    idle = {p.pid: p.idle_since for p in read.spec().gpus[0].processes}
    assert idle == {5: _at(10), 6: None, 7: None}
    again = cycle(900, {5: 3, 6: 31, 7: None})
    assert meaningful_change(last, again.fingerprint(), 64), "active again: one change"
    assert all(p.idle_since is None for p in again.spec().gpus[0].processes)
