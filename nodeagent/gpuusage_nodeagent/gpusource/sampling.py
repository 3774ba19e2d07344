"""Reads of a device's utilization sampler, as the sources hand them to the activity rule.

The driver's per-process utilization is a sampler, not a meter (see driverfacts and
drivermodel): each read returns, per process, its latest sample since the cursor, and the
driver keeps only the last 72 samples. So a source reads it between the agent's cycles too
(every SAMPLE_READ_EVERY seconds at most), and what the activity rule needs from each read is
how long it covered, which processes it showed at work, and which it showed at all; the
compute share (see share) also needs each entry's timestamp.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

Sample = tuple[int, int, int, int, int, int]
"""(pid, timestamp in µs, SM %, memory %, encoder %, decoder %), as NVML's sample struct."""


def any_engine(sm: int, mem: int, enc: int, dec: int) -> bool:
    """Whether a utilization sample shows work on any engine: SMs, the memory controller, the
    video encoder, the video decoder (a transcoding pod uses NVENC/NVDEC and no SM)."""
    return bool(sm or mem or enc or dec)


@dataclass(frozen=True)
class SampleBatch:
    """One read of a device's sampler."""

    at: datetime
    """When it was read (the source's clock)."""
    span: float
    """Seconds since the device's previous read; 0 for the first (its samples may be older)."""
    busy: frozenset[int]
    """Pids with a sample since the previous read that shows work on an engine."""
    sampled: frozenset[int]
    """Pids with any sample since the previous read."""
    entries: tuple[tuple[int, int], ...] = ()
    """The read's entries as (timestamp in µs on the driver's clock, pid), oldest first: each
    the latest sample of its process since the read's start. Kept for the share's reads
    (share_batch) only; the activity rule needs none."""


def share_since(now: datetime, span: float, last: datetime | None) -> datetime:
    """Where a read for the share starts: `span` seconds back, or where the device's last one
    ended if that is later, so that no instant is counted twice."""
    since = now - timedelta(seconds=span)
    return since if last is None or last < since else last


def share_batch(samples: Iterable[Sample], at: datetime, span: float) -> SampleBatch:
    """A read of the last `span` seconds of a sampler, made for the share (see share): its
    entries only, the cursor of the activity rule's reads left where it is."""
    entries = sorted((stamp, pid) for pid, stamp, *_ in samples)
    sampled = frozenset(pid for _, pid in entries)
    return SampleBatch(at, span, frozenset(), sampled, tuple(entries))


Latest = dict[int, tuple[int, int, bool]]
"""Per pid sampled since the last reading: its latest sample's SM and memory percentages, and
whether any of its samples showed work."""


class SampleCursor:
    """One device's reads since the agent's last reading: the cursor into the driver's ring,
    the batches, and each pid's latest values."""

    def __init__(self) -> None:
        self.since_us = 0
        self._last: datetime | None = None
        self._batches: list[SampleBatch] = []
        self._latest: dict[int, tuple[int, int, int]] = {}
        self._busy: set[int] = set()

    def take(self, samples: Iterable[Sample], at: datetime) -> None:
        """Record one read's samples (pid, µs, SM, memory, encoder, decoder)."""
        busy: set[int] = set()
        sampled: set[int] = set()
        newest = self.since_us
        latest = self._latest
        for pid, stamp, sm, mem, enc, dec in samples:
            sampled.add(pid)
            if any_engine(sm, mem, enc, dec):
                busy.add(pid)
            known = latest.get(pid)
            if known is None or stamp >= known[0]:
                latest[pid] = (stamp, sm if sm <= 100 else 100, mem if mem <= 100 else 100)
            newest = max(newest, stamp)
        self.since_us = newest
        span = 0.0 if self._last is None else max((at - self._last).total_seconds(), 0.0)
        self._last = at
        self._busy |= busy
        self._batches.append(SampleBatch(at, span, frozenset(busy), frozenset(sampled)))

    def drain(self) -> tuple[list[SampleBatch], Latest]:
        """The batches since the last drain and the values they showed; starts afresh."""
        batches, latest, busy = self._batches, self._latest, self._busy
        self._batches, self._latest, self._busy = [], {}, set()
        return batches, {pid: (sm, mem, pid in busy) for pid, (_, sm, mem) in latest.items()}
