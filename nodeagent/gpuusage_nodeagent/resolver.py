"""Attribute host pids to containers and pods by reading <proc-root>/<pid>/{stat,cgroup,comm}.

The cache is keyed by (pid, start time): a pid reused by a new process gets a new entry, while
a long-running training job is read once. Entries of processes not seen in a cycle are dropped,
so the cache never grows beyond the processes currently on the GPUs. Only the command *name*
(`comm`) is ever read as a name: command lines carry secrets such as tokens passed as flags.

"Could not read" is not "exited": a process the GPU library still lists holds GPU memory,
whatever its /proc files say. When its files cannot be read (an unreadable or unparseable
cgroup file, a hidden /proc, a pid namespace the agent cannot see) the process keeps the
attribution last read for it, with the reason, for `grace`; after that it is published without
one, still with the reason, which the operator takes as "use unknown", never as "ended". A
process never read successfully is unresolved from the start.

A pid is not a process. NVML can go on listing a pid after its process is gone (a context kept
alive by a child that inherited the device files); once the kernel hands that number to a new
process, possibly another pod's, the old process's memory would be charged to it. So the
resolver remembers since when (seconds since boot) NVML has listed each pid without a break,
and a process that started after that is not the one listed: it is unresolved with the reason,
never attributed (which the operator turns into Unknown on that device, not into use).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuusage import procfs
from gpuusage_nodeagent.cgroup import (
    CgroupAttribution,
    Roots,
    UnparseableCgroup,
    parse_cgroup_file,
)
from gpuusage_nodeagent.identity import Identity, StatIdentities

MAX_NAME = 64
DEFAULT_GRACE = 120.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
REUSE_SLACK = 1.0
"""Seconds a process may appear to start after its pid was first listed (clock granularity)."""


def reused(start_ticks: int, listed_since: float) -> bool:
    """Whether a process that started at `start_ticks` (since boot) cannot be the one NVML has
    listed under its pid since `listed_since` (seconds since boot)."""
    return start_ticks / CLOCK_TICKS > listed_since + REUSE_SLACK


@dataclass(frozen=True)
class Resolved:
    """What the agent learned about one pid."""

    attribution: CgroupAttribution
    comm: str | None
    error: str | None = None


def clean_name(raw: str | bytes | None) -> str | None:
    """A publishable process name: the basename of an executable path, no arguments, bounded.

    NVML returns the executable's path (bytes on older bindings); anything after a NUL or a
    space is dropped so that a command line can never leak through.
    """
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    text = text.split("\0", 1)[0].strip().split(" ", 1)[0]
    name = text.rstrip("/").rsplit("/", 1)[-1]
    return name[:MAX_NAME] or None


def carried_over(last: Resolved, problem: str, failing_for: float, grace: float) -> Resolved:
    """What to publish for a process whose files cannot be read now, given what was last read.

    Within the grace period: the last attribution, with the reason. After it: no attribution,
    the reason and the pod it last belonged to. The texts stay the same from cycle to cycle,
    so a lasting failure causes no writes of its own.
    """
    if failing_for <= grace:
        kept = f"{problem}; showing the attribution last read"
        return Resolved(last.attribution, last.comm, kept)
    pod = last.attribution.pod_uid or last.attribution.container_id or "none"
    return Resolved(
        CgroupAttribution(),
        last.comm,
        f"{problem} for more than {grace:.0f}s; last known pod {pod} (its use is unknown)",
    )


class Resolver:
    """pid → Resolved, with a cache keyed by (pid, start time).

    Reading a start time costs an open and a read per process per cycle, the largest part of a
    cycle at hundreds of GPU processes. An identity of the process, read for all listed pids
    at once (see identity: a stat of its stat file), tells whether it is
    still the process the start time was read from; anything else falls back to reading the
    start time.

    `clock` (monotonic seconds) times how long a process's files have been unreadable.
    `roots`: the kubelet's cgroup root per hierarchy (cgroup.kubelet_roots), where known.
    `identities`: where the identities are read (by default, the proc root's).
    """

    def __init__(
        self,
        proc_root: Path,
        *,
        grace: float = DEFAULT_GRACE,
        clock: Callable[[], float] = time.monotonic,
        roots: Roots | None = None,
        boot_clock: Callable[[], float | None] | None = None,
        identities: StatIdentities | None = None,
    ) -> None:
        self.proc_root = proc_root
        self.identities = identities if identities is not None else StatIdentities(proc_root)
        self.roots = roots or {}
        self._boot_clock = boot_clock or (lambda: procfs.uptime(proc_root))
        """Seconds since boot (the proc root's uptime); None: not known, no reuse judged."""
        self._listed_since: dict[int, float | None] = {}
        """pid → when (seconds since boot) NVML began listing it, while it stays listed."""
        self.grace = grace
        self._clock = clock
        self._cache: dict[tuple[int, int], Resolved] = {}
        self._seen: set[tuple[int, int]] = set()
        self._identity: dict[int, tuple[tuple[int, int], Identity]] = {}
        """pid → (cache key, the process's identity when the key was read)."""
        self._last: dict[int, tuple[int, Resolved]] = {}
        """pid → (start time, the last attribution read successfully), while it is listed."""
        self._failing: dict[int, float] = {}
        """pid → when its files were first found unreadable (clock), while they stay so."""
        self._listed: set[int] = set()
        self._steady: dict[int, Resolved] = {}
        """pid → the answer for a process resolved without a problem: while it keeps the
        identity in `_identity`, the answer stands (a process's start time, cgroup and
        name do not change, and it was listed without a break since)."""
        self._listed_before: set[int] = set()
        self._settled = True
        """Whether every pid of this cycle kept last cycle's answer (see end_cycle)."""
        self.reads = 0  # cgroup files read; lets tests and metrics see the cache working

    def resolve(self, pid: int) -> Resolved:
        return self.resolve_all((pid,))[pid]

    def resolve_all(self, pids: Iterable[int]) -> dict[int, Resolved]:
        """Each listed pid's answer; their identities are read in one go."""
        listed = list(pids)
        ids = self.identities.of(listed)
        return {pid: self._resolve(pid, ids[pid]) for pid in listed}

    def _resolve(self, pid: int, identity: Identity | None) -> Resolved:
        self._listed.add(pid)
        known = self._identity.get(pid)
        steady = self._steady.get(pid)
        if steady is not None and known is not None and identity == known[1]:
            self._seen.add(known[0])  # the same process as last cycle: its answer stands
            return steady
        self._settled = False
        self._steady.pop(pid, None)
        if pid not in self._listed_since:  # the clock is read once per newly listed pid
            self._listed_since[pid] = self._boot_clock()
        listed_since = self._listed_since[pid]
        ticks, found = self._read(pid, identity)
        if ticks is not None and listed_since is not None and reused(ticks, listed_since):
            return Resolved(
                CgroupAttribution(),
                found.comm,
                f"pid {pid} was reused: NVML has listed it since before the process that now "
                "has it started, so the GPU memory is an exited process's (its context kept "
                "by another process?)",
            )
        if found.error is None and ticks is not None:
            self._last[pid] = (ticks, found)
            self._failing.pop(pid, None)
            known = self._identity.get(pid)
            if known is not None and known[0][1] == ticks:
                self._steady[pid] = found
            return found
        last = self._last.get(pid)
        if last is None or (ticks is not None and ticks != last[0]):
            return found  # never read, or another process now has this pid
        since = self._failing.setdefault(pid, self._clock())
        return carried_over(last[1], found.error or "", self._clock() - since, self.grace)

    def _read(self, pid: int, identity: Identity | None) -> tuple[int | None, Resolved]:
        """(start time if known, what the files say) for one pid whose process has `identity`
        now."""
        known = self._identity.get(pid)
        if identity is not None and known is not None and known[1] == identity:
            cached = self._cache.get(known[0])
            if cached is not None:  # the same process as when its start time was read
                self._seen.add(known[0])
                return known[0][1], cached
        ticks = procfs.start_ticks(pid, self.proc_root)
        if ticks is None:
            return None, Resolved(
                CgroupAttribution(),
                None,
                f"pid {pid} not found under {self.proc_root}: it exited, or the agent does not "
                "see the host's processes (hostPID or the host's /proc via --proc-root)",
            )
        key = (pid, ticks)
        self._seen.add(key)
        cached = self._cache.get(key)
        if cached is not None:
            return ticks, cached
        base = self.proc_root / str(pid)
        try:
            text = (base / "cgroup").read_text(errors="replace")
            attribution = parse_cgroup_file(text, self.roots)
        except OSError as exc:
            # Not cached: the next cycle may succeed (a transient permission or race).
            return ticks, Resolved(
                CgroupAttribution(), None, f"cannot read {base}/cgroup: {exc.strerror}"
            )
        except UnparseableCgroup as exc:
            return ticks, Resolved(CgroupAttribution(), None, f"cannot parse {base}/cgroup: {exc}")
        self.reads += 1
        try:
            comm = clean_name((base / "comm").read_text(errors="replace"))
        except OSError:
            comm = None
        # The pid may have been reused between the stat and cgroup reads; re-check.
        if procfs.start_ticks(pid, self.proc_root) != ticks:
            return None, Resolved(
                CgroupAttribution(), None, f"pid {pid} exited during the observation"
            )
        resolved = Resolved(attribution, comm)
        self._cache[key] = resolved
        if identity is not None:
            self._identity[pid] = (key, identity)
        return ticks, resolved

    def end_cycle(self) -> None:
        """Forget processes not seen since the previous call."""
        if self._settled and self._listed == self._listed_before:
            # The same processes as last cycle, each answered as then: nothing to forget.
            self._seen, self._listed = set(), set()
            return
        self._listed_before, self._settled = self._listed, True
        self._cache = {k: v for k, v in self._cache.items() if k in self._seen}
        self._identity = {pid: v for pid, v in self._identity.items() if v[0] in self._seen}
        self._last = {pid: v for pid, v in self._last.items() if pid in self._listed}
        self._failing = {pid: v for pid, v in self._failing.items() if pid in self._listed}
        self._listed_since = {
            pid: v for pid, v in self._listed_since.items() if pid in self._listed
        }
        self._steady = {pid: v for pid, v in self._steady.items() if pid in self._listed}
        self._seen = set()
        self._listed = set()

    def __len__(self) -> int:
        return len(self._cache)
