"""Idle processes, agent side: the tracker's transitions, and that only they reach a report."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage_nodeagent.activity import (
    ACTIVE,
    ActivityTracker,
    Verdict,
    samples_needed,
    seconds_needed,
)
from gpuusage_nodeagent.change import meaningful_change
from gpuusage_nodeagent.gpusource.fake import FakeSource
from gpuusage_nodeagent.gpusource.sampling import SampleBatch
from gpuusage_nodeagent.main import NodeReader, wait_polling
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.share import ShareSchedule
from tests.fakenvml import gpu_uuid, mig_uuid

T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)
KEY = (gpu_uuid(0), 42)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _batch(seconds: float, span: float, busy: tuple[int, ...] = (), others: int = 0) -> SampleBatch:
    """A read of the sampler at `seconds` covering `span` seconds, showing `busy` at work and
    `others` more pids sampled."""
    sampled = frozenset(busy) | frozenset(range(1000, 1000 + others))
    return SampleBatch(_at(seconds), span, frozenset(busy), sampled)


def _verdict(
    tracker: ActivityTracker,
    at: float,
    active: bool | None,
    *,
    busy: tuple[int, ...] = (),
    span: float = 10,
    listed: int = 1,
) -> Verdict:
    """The tracker's verdict on pid 42 after one read at `at`, with `listed` processes on the
    device (42 and others never seen at work)."""
    processes = [(42, active), *((900 + n, False) for n in range(listed - 1))]
    return tracker.device(KEY[0], processes, [_batch(at, span, busy)], _at(at))[42]


def test_idle_once_quiet_for_the_whole_window_since_the_quiet_began() -> None:
    tracker = ActivityTracker(WINDOW)
    assert _verdict(tracker, 0, True, busy=(42,)) == ACTIVE
    assert _verdict(tracker, 10, False) == ACTIVE
    assert _verdict(tracker, 309, False) == ACTIVE, "not yet the whole window"
    assert _verdict(tracker, 310, False) == Verdict(idle_since=_at(10))
    assert _verdict(tracker, 900, False).idle_since == _at(10), "the same, cycle after cycle"
    assert _verdict(tracker, 910, True, busy=(42,)) == ACTIVE, "active again at once"
    assert _verdict(tracker, 920, False) == ACTIVE, "the quiet starts over"
    assert _verdict(tracker, 1220, False).idle_since == _at(920)


def test_unknown_is_never_idle_and_starts_the_quiet_over() -> None:
    tracker = ActivityTracker(WINDOW)
    _verdict(tracker, 0, False)
    assert _verdict(tracker, 400, None) == ACTIVE
    assert _verdict(tracker, 410, False) == ACTIVE
    assert _verdict(tracker, 710, False).idle_since == _at(410)
    for later in range(0, 3600, 60):
        verdicts = tracker.device(mig_uuid(0), [(7, None)], [], _at(later))
        assert verdicts[7] == ACTIVE


def test_a_process_gone_is_forgotten() -> None:
    """A pid the device stopped listing, listed again later, is a new process; so is every
    process of a device no longer read."""
    tracker = ActivityTracker(WINDOW)
    _verdict(tracker, 0, False)
    tracker.device(KEY[0], [], [_batch(10, 10)], _at(10))
    assert _verdict(tracker, 400, False) == ACTIVE, "a new process under an old pid"
    assert _verdict(tracker, 700, False).idle_since == _at(400)
    tracker.forget_devices_except([])
    assert _verdict(tracker, 1000, False) == ACTIVE, "the device's processes start afresh"


def test_samples_needed_grow_with_the_processes_sharing_the_sampler() -> None:
    """(1 - 1/N)^S below one in a million: a lone process needs one sample, two need 20,
    32 need 436, 64 need 878; at the counted rate of 4 a second, 64 need 220 s."""
    assert [samples_needed(n) for n in (1, 2, 8, 32, 64)] == [1, 20, 104, 436, 878]
    assert seconds_needed(64) == pytest.approx(219.5)
    assert samples_needed(32, doubt=1e-3) < samples_needed(32)


def test_a_quiet_process_among_many_is_unsure_until_the_samples_vouch_for_it() -> None:
    """32 processes on the device: 4 s of reads say little about one the sampler has not
    named; quiet for the window it is unsure (activity not known), and idle only once the
    reads since its quiet began make a busy process's miss less likely than one in a million
    (436 samples: 109 s at 4 a second)."""
    tracker = ActivityTracker(timedelta(seconds=4))
    _verdict(tracker, 0, False, listed=32, span=1)
    t, verdicts = 0, []
    while t < 130:
        t += 1
        verdicts.append((t, _verdict(tracker, t, False, listed=32, span=1)))
    unsure = [t for t, v in verdicts if v.unsure]
    idle = [t for t, v in verdicts if v.idle_since is not None]
    assert unsure[0] == 4, "quiet for the window, the samples not enough: not known"
    assert idle[0] == unsure[-1] + 1
    assert idle[0] == 109, "idle once 436 samples passed since its quiet began"
    assert all(v.idle_since == _at(0) for _, v in verdicts if v.idle_since)


def test_a_read_later_than_the_ring_lasts_tells_nothing() -> None:
    """The driver keeps 72 samples: a read 20 s after the last may have lost the ones that
    named the process, so its quiet starts over at that read."""
    tracker = ActivityTracker(timedelta(seconds=30))
    _verdict(tracker, 0, False, listed=2, span=5)
    assert _verdict(tracker, 40, False, listed=2, span=5).idle_since == _at(0)
    assert _verdict(tracker, 60, False, listed=2, span=20) == ACTIVE, "the ring ran over"
    assert _verdict(tracker, 85, False, listed=2, span=5) == ACTIVE
    assert _verdict(tracker, 95, False, listed=2, span=10).idle_since == _at(60)


def test_a_read_that_sampled_nothing_vouches_for_every_quiet_process() -> None:
    """Had a listed process been at work, the sampler would have named someone; a read with
    no sample at all over a span of samples is what an idle device looks like."""
    tracker = ActivityTracker(timedelta(seconds=10))
    device = gpu_uuid(0)
    processes = [(pid, False) for pid in range(1, 9)]
    tracker.device(device, processes, [_batch(0, 1)], _at(0))
    verdicts = tracker.device(device, processes, [_batch(t, 1) for t in range(1, 11)], _at(10))
    assert not any(v.idle_since for v in verdicts.values()), "(7/8)^40 is not enough"
    verdicts = tracker.device(device, processes, [_batch(t, 1) for t in range(11, 30)], _at(29))
    assert all(v.idle_since == _at(0) for v in verdicts.values())


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
        FakeSource(path, clock=lambda: now[0]),
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


class FakeClock:
    """A threading.Event and monotonic clock in one, on the test's time: waiting moves it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def is_set(self) -> bool:
        return False

    def wait(self, seconds: float) -> bool:
        self.now += seconds
        return False

    def monotonic(self) -> float:
        return self.now


def test_between_cycles_the_samplers_are_read_often_enough_for_the_ring(tmp_path: Path) -> None:
    """With --interval 60 the agent reads the samplers every 10 s between cycles (the driver's
    72 samples last 12.6 to 14.4 s), and not once more after the cycle is due."""
    clock = FakeClock(100.0)
    polls: list[float] = []

    class Source:
        def read(self) -> Any:
            raise AssertionError("a wait reads no GPU")

        def poll(self) -> None:
            polls.append(clock.now)

        def sample_shares(self, devices: Collection[str], span: float) -> None:
            """No share reads."""

        def close(self) -> None:
            """Nothing to release."""

    reader = NodeReader("n1", Source(), Resolver(tmp_path))
    wait_polling(reader, clock, 160.0, monotonic=clock.monotonic)  # type: ignore[arg-type]
    assert polls == [110.0 + 10 * n for n in range(5)]
    assert clock.now == 160.0


def test_the_shared_gpus_are_read_every_share_read_every_across_cycles() -> None:
    """With --interval 10 and --share-read-every 2, the short share reads come 2 s apart on
    average, each interval drawn between 1 and 3 s (see share.read_interval), on one schedule
    across the cycles (a read that fell due during a cycle is made right after it, and the next
    is an interval after the one that fell due): 5 reads every 10 s; with the share off, the
    ring's reads alone."""
    clock = FakeClock(100.0)
    calls: list[tuple[str, float]] = []

    class Reader:
        def poll(self) -> None:
            calls.append(("poll", clock.now))

        def sample_shares(self) -> None:
            calls.append(("share", clock.now))

    def waited(until: float, shares: ShareSchedule | None) -> list[float]:
        calls.clear()
        wait_polling(
            Reader(),  # type: ignore[arg-type]
            clock,  # type: ignore[arg-type]
            until,
            monotonic=clock.monotonic,
            shares=shares,
        )
        return [round(at, 3) for kind, at in calls if kind == "share"]

    middle = ShareSchedule(2.0, draw=lambda: 0.5)  # each interval at the middle: 2 s
    assert waited(110.0, middle) == [102.0, 104.0, 106.0, 108.0]
    assert waited(120.0, middle) == [110.0, 112.0, 114.0, 116.0, 118.0], "the same schedule"
    drawn = iter([0.0, 0.999, 0.25])
    apart = ShareSchedule(2.0, draw=lambda: next(drawn, 0.5))
    clock.now = 150.0
    assert waited(156.0, apart) == [151.0, 153.998, 155.498], "1 s to 3 s apart"
    clock.now = 200.0
    assert waited(260.0, None) == []
    assert [kind for kind, _ in calls] == ["poll"] * 5, "the ring's reads alone, every 10 s"
