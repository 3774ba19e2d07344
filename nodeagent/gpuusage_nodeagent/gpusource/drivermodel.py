"""The driver as it was measured (see driverfacts), for the fake sources: the scenario source
the demo runs on, and the tests' fake NVML. Pure but for a seeded random choice.

What it reproduces, each a way the real driver differs from a naive fake:

* Bookkeeping: the driver keeps about 5.8 MiB per CUDA context that no process is charged
  with, so a device's used memory is more than its processes' and its reserved part.
* The utilization sampler: about 5 samples a second, each naming the one process active on the
  engine at that instant (none when nothing runs), the last 72 kept. A read from a timestamp
  returns at most one entry per process, its latest since then. A busy process among many can
  go unsampled for seconds; an idle one never appears.
* MPS: the clients' work is sampled under the MPS server's pid; the clients get no sample.
* Part-time work: a process with a duty below 1 has work for the first `duty` of each period of
  about a second (as the measured tenants had, in each second), each process's periods at
  their own phase (the measured tenants started at unrelated instants: the model's hypothesis
  for why the longer count differs from the first probe's), and the engine is
  sliced between the processes that have work at the same instant, a process whose work
  begins waiting for its turn behind those already at work: duties 1.0, 0.5 and 0.2 get about
  70 %, 22 % and 8 %, where the real H200 gave 68.1 %, 22.5 % and 9.3 % of 1,500 samples
  (each within two of that count's standard deviations; docs/real-driver.md, "The share on
  the real driver").

The sampler keeps a tally of every sample it takes (`tally`): what reading at its own rate would
count, which tests and benchmarks take as the truth a share is measured against.
"""

from __future__ import annotations

import bisect
import random
import zlib
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuusage_nodeagent.driverfacts import CONTEXT_MIB, SAMPLE_RING, SAMPLES_PER_SECOND
from gpuusage_nodeagent.gpusource.sampling import Sample

MPS_SERVER = "nvidia-cuda-mps-server"


def bookkeeping_mib(contexts: int) -> int:
    """Memory the driver keeps for `contexts` CUDA contexts beyond what it charges processes."""
    return round(CONTEXT_MIB * contexts)


DUTY_PERIOD_US = 1_031_000
"""The period of part-time work: a process of duty d has work in the first d of each period,
about a second (not a whole number of the sampler's periods, so that its instants fall all
over the period rather than on the same few points of it)."""


@dataclass(frozen=True)
class Work:
    """What one process does on its device's engines: the share of the time it has work there
    (1.0 always, 0 never) and the percentages a sample of it shows."""

    duty: float
    sm: int = 0
    mem: int = 0
    enc: int = 0
    dec: int = 0
    period_us: int = DUTY_PERIOD_US
    """The period of its part-time work (duty below 1)."""
    phase_us: int | None = None
    """Where in the timeline its periods begin; None: the sampler draws one when it first sees
    the process, as processes start their work at unrelated instants."""


IDLE = Work(0.0)


def work_of(sm: int | None, mem: int | None, enc: int | None, dec: int | None) -> Work:
    """A process busy on any engine in the scenario's terms: at work all the time."""
    values = (sm or 0, mem or 0, enc or 0, dec or 0)
    return Work(1.0 if any(values) else 0.0, *values)


def under_mps_server(
    work: Mapping[int, Work], clients: Iterable[int], server: int | None
) -> dict[int, Work]:
    """The work as the sampler sees it: an MPS client's goes to the server's pid (and is lost
    where no server is listed), the clients themselves are never sampled."""
    seen = dict(work)
    busiest = IDLE
    for pid in clients:
        client = seen.pop(pid, IDLE)
        if client.duty > busiest.duty:
            busiest = client
    if server is not None and busiest.duty > seen.get(server, IDLE).duty:
        seen[server] = busiest
    return seen


def has_work(work: Work, at_us: int, phase_us: int = 0) -> bool:
    """Whether a process doing `work`, its periods beginning at `phase_us` (work.phase_us
    where it names one), has work for the engine at `at_us`."""
    if work.duty >= 1:
        return True
    phase_us = phase_us if work.phase_us is None else work.phase_us
    return work.duty > 0 and (at_us - phase_us) % work.period_us < work.duty * work.period_us


TIME_SLICE_US = 100_000
"""The mean time slice of the model's engine, fitted to the measured reads: with 48 busy
processes, a read every 1, 5 and 10 s returns 5, 24 and 36 of them (measured: 5, 24-25, 39-41),
with 32 busy 5, 21 and 28 (measured on the H100: 5, 22-23, 30-31)."""


class Sampler:
    """One device's per-process utilization sampler over a time-sliced engine: the processes
    with work at an instant take turns (slices of random length, mean TIME_SLICE_US; one whose
    work ends gives the engine up at once); each sample names the one on the engine at that
    instant, none when nobody has work."""

    def __init__(
        self,
        seed: int | str = 0,
        rate: float = SAMPLES_PER_SECOND,
        ring: int = SAMPLE_RING,
        history: bool = False,
    ) -> None:
        """`history`: at the first advance, the ring is full of samples of the work as it is
        then, as a driver's is when the agent starts beside running processes."""
        if isinstance(seed, str):
            seed = zlib.crc32(seed.encode())
        self._random = random.Random(seed)
        self._phase_random = random.Random(seed + 1)  # its own: the slices' draws stay as they were
        self._period_us = int(1_000_000 / rate)
        self._capacity = ring
        self._ring: deque[Sample] = deque(maxlen=ring)
        self._next_us: int | None = None
        self._history = history
        self._running: int | None = None  # the pid on the engine, until _slice_end_us
        self._last = -1  # the pid that ran last: the turns go on from it
        self._slice_end_us = 0
        self._phases: dict[int, int] = {}  # pid → where its periods begin (see Work.phase_us)
        self._recent: deque[bool] = deque(maxlen=max(int(rate), 1))
        self.tally: Counter[int | None] = Counter()
        """Every sample taken since the first advance, by pid (None: nobody on the engine):
        what reading the sampler at its own rate would count."""

    def advance(self, now_us: int, work: Mapping[int, Work]) -> None:
        """Take the samples due up to `now_us` with `work` as it has been since the last call."""
        if self._next_us is None:
            past = (self._capacity - 1) * self._period_us if self._history else 0
            # The sampler's instants fall anywhere in a second of the processes' work.
            phase = self._random.randrange(self._period_us)
            self._next_us = self._slice_end_us = now_us - past - phase
        due = (now_us - self._next_us) // self._period_us + 1
        if due > self._capacity:  # older instants would only fall out of the ring
            self._next_us += (due - self._capacity) * self._period_us
            self._slice_end_us = max(self._slice_end_us, self._next_us - self._period_us)
        turns = sorted(pid for pid, w in work.items() if w.duty > 0)
        for new in turns:
            if new not in self._phases and work[new].duty < 1:
                self._phases[new] = self._phase_random.randrange(work[new].period_us)
        while self._next_us <= now_us:
            pid = self._on_engine(self._next_us, turns, work)
            self.tally[pid] += 1
            self._recent.append(pid is not None)
            if pid is not None:
                w = work[pid]
                self._ring.append((pid, self._next_us, w.sm, w.mem, w.enc, w.dec))
            self._next_us += self._period_us

    def _on_engine(self, at_us: int, turns: list[int], work: Mapping[int, Work]) -> int | None:
        """Who runs at `at_us`: the slices since the last instant passed in turn."""
        if not turns:
            self._running = None
            return None
        running = self._running
        if running is None:  # an idle engine: a process with work now starts at once
            self._slice_end_us = at_us
        while (
            running is None
            or self._slice_end_us < at_us
            or running not in work
            or not has_work(work[running], at_us, self._phases.get(running, 0))
        ):
            # The turn goes to the next process that had work when the last slice ended: one
            # whose work began since waits for its turn behind those already at work.
            running = self._running = self._next_turn(turns, work, min(self._slice_end_us, at_us))
            if running is None:  # nobody has work now
                self._slice_end_us = at_us
                return None
            self._last = running
            self._slice_end_us += self._random.randint(0, 2 * TIME_SLICE_US)
        return running

    def _next_turn(self, turns: list[int], work: Mapping[int, Work], at_us: int) -> int | None:
        """The next process in turn after the last one that ran, of those that had work at
        `at_us` (one round at most)."""
        start = bisect.bisect_right(turns, self._last)
        for step in range(len(turns)):
            pid = turns[(start + step) % len(turns)]
            if has_work(work[pid], at_us, self._phases.get(pid, 0)):
                return pid
        return None

    def busy_percent(self) -> int | None:
        """The device's utilization meter: the share of the last second's instants at which a
        process was on the engine (None before the first)."""
        if not self._recent:
            return None
        return round(100 * sum(self._recent) / len(self._recent))

    def read(self, since_us: int) -> list[Sample]:
        """What NVML returns for a read from `since_us`: each process's latest sample after it,
        oldest first."""
        latest: dict[int, Sample] = {}
        for sample in self._ring:
            if sample[1] > since_us:
                latest[sample[0]] = sample
        return sorted(latest.values(), key=lambda s: s[1])
