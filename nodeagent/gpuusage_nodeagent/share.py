"""Each process's share of its device's time over the share window. Pure, clock passed in.

The question on a GPU several pods share is who gets the compute. The driver's per-process
utilization is a sampler (see driverfacts): about 5 instants a second, each naming the one
process on the engine then, none when nobody has work. A read returns each process's latest
sample after the timestamp it is given, so one read a scrape (what dcgm-exporter and HAMi-core
publish) shows every tenant of a busy GPU at the value of the instant it last ran: all look
equal, whatever each got.

What a read of the last few instants tells, exactly:

* the instant at each entry's timestamp belonged to that entry's process;
* the instants after the newest entry belonged to nobody (a process on the engine then would
  have left a later sample);
* an instant between two entries belonged to one of the processes whose latest entry is later,
  or to nobody.

Counting every instant would take a read per instant (5 a second per GPU: 7 % of a core at 8
GPUs, on the measured call costs). The agent instead reads a short span, SHARE_READ_SPAN (three
of the sampler's instants), every --share-read-every seconds on a GPU several processes share:
each read tells its instants exactly or nearly (an instant without an entry has one or two
candidates), the reads are spread over the window at drawn intervals (read_interval: a fixed
period would see periodic work at one phase only), and the share is the fraction of the sampled
instants that were the process's. The few uncertain instants are split
among their candidates in proportion to their shares, which makes the fraction the
maximum-likelihood fit of all the facts above (expectation-maximisation, warm-started from the
last cycle's answer). Reads from the last read on would say more per call, but most of their
instants are uncertain, with many candidates, and the split takes instants as independent,
which time-structured work is not (a tenant at work in the first half of each second would be
given instants of the other half): short reads keep the share nearly a count, least dependent
on how the driver slices the engine (benchmarks/README.md has both on the driver model).

A share is of wall time: the instants that belonged to nobody count too, so a device's shares
add up to at most its busy time. Instants are counted at the sampler's period, taken from the
entries' own timestamps (two entries an instant apart) where the reads show enough of them,
else the measured rate.

A device with one process needs no reads beyond the cycle's: its process's share is the
device's busy time, which the device's own utilization meter (read every cycle) tells. Where
nothing can vouch for a share it is absent (None), never a guess: a device without per-process
utilization (MIG devices, some GPUs), MPS clients (their samples go to the server), and reads
that cover less than half the window yet.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpuusage_nodeagent.driverfacts import RING_LASTS, SAMPLES_PER_SECOND
from gpuusage_nodeagent.gpusource.sampling import SampleBatch

DEFAULT_WINDOW = timedelta(minutes=5)
DEFAULT_READ_EVERY = 2.0
"""The agent's --share-window and --share-read-every defaults."""
NOMINAL_PERIOD_US = 1_000_000 / SAMPLES_PER_SECOND
SHARE_READ_SPAN = 3 / SAMPLES_PER_SECOND
"""Seconds a read for the share covers: three of the sampler's instants (see above)."""
JITTER = 0.5
"""The share reads come every --share-read-every on average, each interval drawn from that
times [1 - JITTER, 1 + JITTER)."""


def read_interval(every: float, draw: Callable[[], float] = random.random) -> float:
    """Seconds to the next share read. Reads at a fixed period would fall on the same phase of
    work that has a period of its own (a training step of a fixed length, a tenant busy the
    first half of each second) and count that phase alone: drawn intervals spread them over
    every phase."""
    return every * (1 - JITTER + 2 * JITTER * draw())


class ShareSchedule:
    """When the next share read is due, on a monotonic clock: one drawn interval after another
    (read_interval), across the agent's cycles, so the reads come every `every` seconds on
    average whatever --interval is."""

    def __init__(self, every: float, draw: Callable[[], float] = random.random) -> None:
        self.every = every
        self._draw = draw
        self._next: float | None = None

    def next_at(self, now: float) -> float:
        """When the next read is due (the first: one interval from `now`)."""
        if self._next is None:
            self._next = now + read_interval(self.every, self._draw)
        return self._next

    def read_at(self, now: float) -> None:
        """A read was made at `now`: the next one interval after the one that fell due (from
        `now` where the reads fell behind by more than an interval)."""
        due = self.next_at(now) + read_interval(self.every, self._draw)
        self._next = due if due > now else now + read_interval(self.every, self._draw)


ADJACENT = (0.6, 1.4)
"""Two entries this many nominal periods apart were taken at neighbouring instants."""
ADJACENT_NEEDED = 16
"""Neighbouring entries needed before their spacing is taken for the sampler's period."""
EPSILON = 1e-6
"""Of a period: an instant on a read's boundary counts once."""
ROUNDS_FIRST = 30
ROUNDS_WARM = 6
"""Rounds of the fit: from scratch, and from the last cycle's answer."""


@dataclass(frozen=True)
class Share:
    """A process's share of its device's time, and what it rests on."""

    value: float
    """From 0 to 1, of wall time."""
    samples: int
    """The sampler's instants it rests on (for a device's only process, the meter's
    readings)."""
    seconds: float
    """The span it rests on."""


@dataclass(frozen=True)
class _Read:
    """One read of a device's sampler, as the fit uses it."""

    start_us: float
    end_us: float
    stamps: tuple[float, ...]
    pids: tuple[int, ...]


def _read(batch: SampleBatch) -> _Read | None:
    """A batch as the fit uses it; None for one whose span cannot be told (the first read, one
    later than the ring lasts) or whose entries fall outside it (by more than a period: the
    driver's sample clock would not be the host's, and no instant could be placed)."""
    if batch.span <= 0 or batch.span > RING_LASTS:
        return None
    end = batch.at.timestamp() * 1_000_000
    start = end - batch.span * 1_000_000
    if any(not start - NOMINAL_PERIOD_US <= s <= end + NOMINAL_PERIOD_US for s, _ in batch.entries):
        return None
    inside = [(min(max(float(s), start), end), pid) for s, pid in batch.entries]
    return _Read(start, end, tuple(s for s, _ in inside), tuple(pid for _, pid in inside))


def sampler_period(reads: Iterable[_Read], nominal: float = NOMINAL_PERIOD_US) -> float:
    """The sampler's period (µs) as the entries' spacing shows it, else the nominal one."""
    low, high = ADJACENT[0] * nominal, ADJACENT[1] * nominal
    spacing = [
        b - a
        for read in reads
        for a, b in zip(read.stamps, read.stamps[1:], strict=False)
        if low <= b - a <= high
    ]
    if len(spacing) < ADJACENT_NEEDED:
        return nominal
    return statistics.median(spacing)


@dataclass(frozen=True)
class _Layout:
    """A read in instants: how many, how many known idle (after the newest entry), and before
    each entry how many uncertain ones."""

    slots: float
    idle: float
    gaps: tuple[float, ...]
    pids: tuple[int, ...]
    end_us: float


def _layout(read: _Read, period: float, anchor: float | None) -> _Layout:
    """The sampler's instants fall on a grid of its period through the entries' stamps: so many
    lie before the first entry, between two, and after the newest (each counted whole). A read
    without an entry had only idle instants: as many as the grid through `anchor` (the nearest
    entry of another read) puts in its span; a read shorter than a period may have none, which
    is no idle instant. Without any entry to place the grid, its expected number."""
    if not read.stamps:
        if anchor is None:
            slots = (read.end_us - read.start_us) / period
        else:
            slots = float(
                math.floor((read.end_us - anchor) / period + EPSILON)
                - math.floor((read.start_us - anchor) / period + EPSILON)
            )
        return _Layout(slots, slots, (), (), read.end_us)
    first = max(math.ceil((read.stamps[0] - read.start_us) / period - EPSILON) - 1, 0)
    gaps = [float(first)]
    gaps += [
        max(round((b - a) / period) - 1, 0)
        for a, b in zip(read.stamps, read.stamps[1:], strict=False)
    ]
    idle = float(max(math.floor((read.end_us - read.stamps[-1]) / period + EPSILON), 0))
    slots = sum(gaps) + len(read.stamps) + idle
    return _Layout(slots, idle, tuple(gaps), read.pids, read.end_us)


def _anchors(reads: Sequence[_Read]) -> list[float | None]:
    """For each read, the stamp of an entry nearest to it in time (its own newest, else the
    nearest read's with one): a point of the sampler's grid near its span."""
    found: list[float | None] = [r.stamps[-1] if r.stamps else None for r in reads]
    before: float | None = None
    for i, read in enumerate(reads):  # the nearest earlier one, then a nearer later one
        if read.stamps:
            before = read.stamps[-1]
        elif before is not None:
            found[i] = before
    after: float | None = None
    for i in range(len(reads) - 1, -1, -1):
        read = reads[i]
        if read.stamps:
            after = read.stamps[0]
            continue
        if after is not None and (
            found[i] is None or after - read.end_us < read.start_us - (found[i] or 0.0)
        ):
            found[i] = after
    return found


def fit(
    layouts: Sequence[_Layout],
    covered_from: dict[int, float],
    start: dict[int, float],
    rounds: int,
) -> tuple[dict[int, float], dict[int, float]]:
    """Each process's share of the instants of the reads that end after its `covered_from`
    (µs; a process no longer listed: of all), by `rounds` of expectation-maximisation from
    `start`; with the instants each rests on."""
    pids = set(covered_from)
    for layout in layouts:
        pids.update(layout.pids)
    theta = {pid: start.get(pid, 0.1) for pid in pids}
    theta_idle = start.get(-1, 0.1)
    since = {pid: covered_from.get(pid, -math.inf) for pid in pids}
    slots = dict.fromkeys(pids, 0.0)
    total = 0.0
    for layout in layouts:
        total += layout.slots
        for pid in pids:
            if layout.end_us > since[pid]:
                slots[pid] += layout.slots
    if total <= 0:
        return {}, slots
    for _ in range(rounds):
        counted = dict.fromkeys(pids, 0.0)
        idle = 0.0
        for layout in layouts:
            idle += layout.idle
            order = layout.pids
            suffix = [0.0] * (len(order) + 1)
            for i in range(len(order) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + theta[order[i]]
            spread = 0.0  # Σ over the gaps so far of gap / (its candidates' shares)
            for i, pid in enumerate(order):
                gap = layout.gaps[i]
                if gap > 0:
                    weight = suffix[i] + theta_idle
                    if weight > 0:
                        spread += gap / weight
                        idle += theta_idle * gap / weight
                if layout.end_us > since[pid]:  # its instants count only once it is listed
                    counted[pid] += 1 + theta[pid] * spread
        theta = {pid: min(counted[pid] / slots[pid], 1.0) if slots[pid] else 0.0 for pid in pids}
        theta_idle = idle / total
    return {pid: theta[pid] for pid in covered_from} | {-1: theta_idle}, slots


@dataclass
class _Device:
    reads: deque[_Read] = field(default_factory=deque)
    listed_since: dict[int, float] = field(default_factory=dict)
    theta: dict[int, float] = field(default_factory=dict)
    meter: deque[tuple[float, float]] = field(default_factory=deque)
    lone: int | None = None
    shared: bool = False


class ShareTracker:
    """Keeps each device's sampler reads over the share window, and answers each process's
    share every cycle."""

    def __init__(
        self, window: timedelta = DEFAULT_WINDOW, every: float = DEFAULT_READ_EVERY
    ) -> None:
        """`every`: the reads' mean interval (--share-read-every); a stretch of three times it
        without a read (see ShareSchedule: at most one and a half) breaks what they cover."""
        self.window = window
        self.longest_gap_us = 2 * (1 + JITTER) * every * 1_000_000
        self._devices: dict[str, _Device] = {}

    @property
    def enabled(self) -> bool:
        return self.window > timedelta(0)

    def device(
        self,
        uuid: str,
        told: Sequence[int],
        batches: Sequence[SampleBatch],
        meter_percent: int | None,
        now: datetime,
    ) -> dict[int, Share | None]:
        """This cycle's share for each of a device's processes whose activity the source tells
        (`told`), from the sampler's reads since the last cycle and the device's utilization
        meter now; None where the reads cannot vouch for one yet."""
        if not self.enabled:
            return {}
        state = self._devices.setdefault(uuid, _Device())
        now_us = now.timestamp() * 1_000_000
        horizon = now_us - self.window.total_seconds() * 1_000_000
        state.reads.extend(r for b in batches if (r := _read(b)) is not None)
        while state.reads and state.reads[0].start_us < horizon:
            state.reads.popleft()
        state.listed_since = {
            pid: max(state.listed_since.get(pid, now_us), horizon) for pid in told
        }
        state.shared = len(told) > 1
        if not state.shared:  # the reads made while it was shared no longer cover it
            state.reads, state.theta = deque(), {}
        if len(told) == 1:
            return {told[0]: self._lone(state, told[0], meter_percent, now_us, horizon)}
        state.lone, state.meter = None, deque()
        return self._shared(state, now_us)

    def _needed_us(self) -> float:
        """The span a share must rest on: half the window."""
        return self.window.total_seconds() * 1_000_000 / 2

    def _lone(
        self, state: _Device, pid: int, percent: int | None, now_us: float, horizon: float
    ) -> Share | None:
        """A device's only process: its share is the device's busy time, as the meter's
        readings since it was alone tell it."""
        if state.lone != pid:
            state.lone, state.meter = pid, deque()
        if percent is not None:
            state.meter.append((now_us, percent / 100))
        while state.meter and state.meter[0][0] < horizon:
            state.meter.popleft()
        if len(state.meter) < 2:
            return None
        span = now_us - state.meter[0][0]
        if span < self._needed_us():
            return None
        value = statistics.fmean(v for _, v in state.meter)
        return Share(value, len(state.meter), span / 1_000_000)

    def _covered_since(self, reads: Sequence[_Read], now_us: float) -> float:
        """Since when the reads cover the device without a stretch longer than longest_gap_us
        between two (or since the last one): the start of that run of reads (now: none)."""
        since = now_us
        later = now_us
        for read in reversed(reads):
            if later - read.end_us > self.longest_gap_us:
                break
            since, later = read.start_us, read.start_us
        return since

    def _shared(self, state: _Device, now_us: float) -> dict[int, Share | None]:
        reads = list(state.reads)
        period = sampler_period(reads)
        anchors = _anchors(reads)
        layouts = [_layout(r, period, a) for r, a in zip(reads, anchors, strict=True)]
        covered_from = dict(state.listed_since)
        rounds = ROUNDS_WARM if state.theta else ROUNDS_FIRST
        theta, slots = fit(layouts, covered_from, state.theta, rounds)
        state.theta = theta
        covered = self._covered_since(reads, now_us)
        spans = {pid: now_us - max(since, covered) for pid, since in covered_from.items()}
        vouched = {p for p, span in spans.items() if p in theta and span >= self._needed_us()}
        # Over spans that differ (a process listed later has a shorter one) the shares may add
        # up to a little more than one GPU's time, which no device gives: scaled down to it.
        scale = 1 / max(sum(theta[p] for p in vouched), 1.0)
        return {
            pid: Share(theta[pid] * scale, round(slots[pid]), spans[pid] / 1_000_000)
            if pid in vouched
            else None
            for pid in covered_from
        }

    def devices(self) -> set[str]:
        """The devices it keeps reads or readings of."""
        return set(self._devices)

    def shared_devices(self) -> list[str]:
        """The devices whose shares need reads between cycles: more than one process told."""
        return [uuid for uuid, state in self._devices.items() if state.shared]

    def forget_devices_except(self, listed: Iterable[str]) -> None:
        keep = set(listed)
        self._devices = {u: s for u, s in self._devices.items() if u in keep}
