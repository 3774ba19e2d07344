"""Since when has each process computed nothing? Pure, with the clock passed in.

Per-process utilization comes every cycle and is noise to a report: a process busy in bursts,
or between two epochs, must not turn idle and active again every cycle, and no write may follow
from a percentage alone. So the agent publishes one thing per process, its `idleSince`: set once
the process has used none of the device's engines (SMs, memory controller, encoder, decoder)
for a whole `window` (to the moment its quiet began), and cleared the first cycle it works
again. The report changes only at those transitions.

The driver's per-process utilization is a sampler, not a meter (measured: see driverfacts):
about 5 samples a second, each naming the one process active on the engine at that instant. A
quiet process is therefore either idle or busy and not sampled yet, and on a GPU that many busy
processes share the second lasts: with 32 of them and a 4 s window, 20 were published idle. An
idle mark feeds policies that delete pods, so quiet alone is not enough. For each quiet
process the tracker adds up the evidence of every read of the sampler since its quiet began:
had it been busy, it would have taken its share (1/N, N the processes on the device) of each
sample the driver took meanwhile (the read's span times the sampler's rate, counted a fifth
low), so the chance that a busy process went unsampled through all of them is the product of
(1 - 1/N) per sample. It is published idle only when that chance is below `doubt` (one in a
million) as well as quiet for the window; quiet for the window without enough samples yet, its
activity is published as not known (never idle). A read later than the driver's ring lasts
cannot tell what it missed: the quiet starts over.

Where the device does not report per-process utilization (MIG devices, some GPUs, a failed
read, MPS clients) nothing is known: the process is never idle, and its quiet time starts over.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuusage_nodeagent.driverfacts import RING_LASTS, SAMPLES_PER_SECOND_COUNTED
from gpuusage_nodeagent.gpusource.sampling import SampleBatch

Key = tuple[str, int]
"""(device UUID, pid)."""

DEFAULT_WINDOW = timedelta(minutes=5)
DEFAULT_DOUBT = 1e-6
"""The chance, at most, that a process published idle was busy and went unsampled."""


def samples_needed(processes: int, doubt: float = DEFAULT_DOUBT) -> int:
    """Samples a busy process among `processes` on a device must have been missed by before
    its quiet is taken for idle."""
    if processes <= 1:
        return 1
    return math.ceil(math.log(doubt) / math.log(1 - 1 / processes))


def seconds_needed(
    processes: int, doubt: float = DEFAULT_DOUBT, rate: float = SAMPLES_PER_SECOND_COUNTED
) -> float:
    """Seconds of sampler reads a quiet process among `processes` needs (docs/real-driver.md
    has the table)."""
    return samples_needed(processes, doubt) / rate


@dataclass
class _Quiet:
    since: datetime
    log_missed: float = 0.0
    """ln of the chance that a busy process went unsampled through the reads since `since`."""


@dataclass(frozen=True)
class Verdict:
    """One cycle's answer for one process."""

    idle_since: datetime | None = None
    """Since when it is idle (quiet for the window, and the sampler vouches for it)."""
    unsure: bool = False
    """Quiet for the window, but the sampler has not shown enough to call it idle."""


ACTIVE = Verdict()
UNSURE = Verdict(unsure=True)
LOST = math.nan
"""What a read later than the ring lasts says: nothing (its quiet starts over)."""


class ActivityTracker:
    """Remembers, per process on a device, since when it has been quiet and what the sampler's
    reads since then say."""

    def __init__(
        self,
        window: timedelta = DEFAULT_WINDOW,
        doubt: float = DEFAULT_DOUBT,
        rate: float = SAMPLES_PER_SECOND_COUNTED,
    ) -> None:
        self.window = window
        self._log_doubt = math.log(doubt)
        self._rate = rate
        self._quiet: dict[str, dict[int, _Quiet]] = {}  # by device UUID, then pid
        self._known: dict[str, set[int]] = {}  # the pids each device listed at the last cycle

    def device(
        self,
        uuid: str,
        processes: Sequence[tuple[int, bool | None]],
        batches: Sequence[SampleBatch],
        now: datetime,
    ) -> dict[int, Verdict]:
        """This cycle's verdicts for a device's processes, given as (pid, active) with `active`
        as the source tells it (None: not known), and its sampler's reads since the last
        cycle. What the tracker remembers of the device is then only of these processes."""
        known = self._known.get(uuid, set())
        listed = max(len(processes), len(known))
        was_quiet = self._quiet.get(uuid, {})
        quiet_now: dict[int, _Quiet] = {}
        self._known[uuid], self._quiet[uuid] = {pid for pid, _ in processes}, quiet_now
        # What each read says of any process it did not show at work: the same for all.
        evidence = [(b.busy, b.at, self._log_missed(b, listed)) for b in batches]
        verdicts: dict[int, Verdict] = {}
        for pid, active in processes:
            if active is None or not evidence:
                verdicts[pid] = ACTIVE
                continue
            # A process first listed now takes only the read at this reading: the earlier
            # ones may predate it.
            if pid in known:
                quiet = self._follow(was_quiet.get(pid), evidence, pid)
            else:
                quiet = self._follow(None, evidence[-1:], pid)
            if quiet is None or active:
                verdicts[pid] = ACTIVE
                continue
            quiet_now[pid] = quiet
            verdicts[pid] = self._verdict(quiet, now)
        return verdicts

    @staticmethod
    def _follow(
        quiet: _Quiet | None, evidence: Iterable[tuple[frozenset[int], datetime, float]], pid: int
    ) -> _Quiet | None:
        """A process's quiet after the reads, in their order; None: it was seen at work."""
        for busy, at, log_missed in evidence:
            if pid in busy:
                quiet = None
            elif quiet is None or math.isnan(log_missed):
                quiet = _Quiet(at)
            else:
                quiet.log_missed += log_missed
        return quiet

    def _log_missed(self, batch: SampleBatch, listed: int) -> float:
        """ln of the chance that a busy process went unsampled through one read's span; LOST
        where the read came later than the driver's ring lasts."""
        if batch.span > RING_LASTS:
            return LOST
        samples = math.floor(batch.span * self._rate)
        if samples == 0:
            return 0.0
        sharing = max(listed, len(batch.sampled) + 1)
        if sharing <= 1:
            return -math.inf
        return samples * math.log(1 - 1 / sharing)

    def _verdict(self, quiet: _Quiet, now: datetime) -> Verdict:
        if now - quiet.since < self.window:
            return ACTIVE
        if quiet.log_missed <= self._log_doubt:
            return Verdict(idle_since=quiet.since)
        return UNSURE

    def forget_devices_except(self, listed: Iterable[str]) -> None:
        """Drop the devices no longer read (their processes' quiet starts afresh)."""
        keep = set(listed)
        self._known = {u: pids for u, pids in self._known.items() if u in keep}
        self._quiet = {u: quiet for u, quiet in self._quiet.items() if u in keep}
