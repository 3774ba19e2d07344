"""One work queue of report names, as client-go's rate-limited delaying queue.

Every reason to reconcile a report goes through it: a report event (held while the report was
reconciled less than a second ago), a deadline (a pod's idle time reaching --idle-after, marks
settling, a policy's notice, the report turning stale), a pod event (a pod listed deleted, a
pod's marks edited, a pod starting or stopping to hold GPUs, a Lease renewed), and a failed
reconcile tried again after a backoff. The queue promises what the operator's correctness
rests on:

* a name is processed by one worker at a time; added again meanwhile, it is processed once
  more afterwards (never lost, never twice at once);
* a name added several times before a worker takes it is processed once, with every reason
  given (a reconcile serves them all);
* `add_after` holds a name until its deadline (the earliest deadline given wins), in one
  entry per name: a deadline replaced by an earlier one is dropped, not kept until its own
  time (with `--stale-after 3600` each report's reconcile left such an entry behind for an
  hour; benchmarks/README.md);
* `add_rate_limited` holds it for a backoff that doubles with each failure in a row (1 s to
  60 s by default), `forget` starts the backoff over.

Thread-safe; the clock is injected.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from itertools import count

from gpuusage.retry import Backoff, doubling

FAILURE_BACKOFF = doubling(1.0, 60.0)
"""A failed reconcile is tried again after 1, 2, 4 ... then every 60 seconds."""


class WorkQueue:
    """See the module's docstring."""

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        backoff: Backoff = FAILURE_BACKOFF,
    ) -> None:
        self._monotonic = monotonic
        self._backoff = backoff
        self._cond = threading.Condition()
        self._ready: deque[str] = deque()
        self._queued: set[str] = set()
        self._processing: set[str] = set()
        self._again: set[str] = set()
        """Added while being processed: queued again when done."""
        self._reasons: dict[str, set[Hashable]] = {}
        self._waiting: list[tuple[float, int, str]] = []
        self._earliest: dict[str, float] = {}
        self._later: dict[str, set[Hashable]] = {}
        """The reasons given with deadlines, told when the name's earliest deadline comes."""
        self._order = count()
        self._failures: dict[str, int] = {}
        self._shut = False

    def add(self, name: str, reason: Hashable | None = None) -> None:
        """Queue a name now (with a reason the worker is told)."""
        with self._cond:
            self._add(name, reason)

    def _add(self, name: str, reason: Hashable | None) -> None:
        if self._shut:
            return
        if reason is not None:
            self._reasons.setdefault(name, set()).add(reason)
        if name in self._processing:
            self._again.add(name)
            return
        if name in self._queued:
            return
        self._queued.add(name)
        self._ready.append(name)
        self._cond.notify()

    def add_after(self, name: str, delay: float, reason: Hashable | None = None) -> None:
        """Queue a name once `delay` seconds have passed; an earlier deadline already given
        for it stands (and brings this reason with it)."""
        with self._cond:
            if delay <= 0:
                self._add(name, reason)
                return
            if self._shut:
                return
            if reason is not None:
                self._later.setdefault(name, set()).add(reason)
            when = self._monotonic() + delay
            if self._earliest.get(name, float("inf")) <= when:
                return
            self._earliest[name] = when
            heapq.heappush(self._waiting, (when, next(self._order), name))
            if len(self._waiting) > 2 * len(self._earliest) + 16:
                self._compact()
            self._cond.notify()

    def _compact(self) -> None:
        """Drop the heap's entries of replaced deadlines (the heap cannot move an entry: an
        earlier deadline is pushed beside the old one, which `_promote` would skip at its own
        time). Done once they outnumber the live ones, so its cost is shared by the pushes."""
        self._waiting = [e for e in self._waiting if self._earliest.get(e[2]) == e[0]]
        heapq.heapify(self._waiting)

    def add_rate_limited(self, name: str) -> float:
        """Queue a name after its backoff (its failures in a row so far); the delay."""
        with self._cond:
            failures = self._failures.get(name, 0)
            self._failures[name] = failures + 1
        delay = self._backoff.delay(failures) or self._backoff.then or 1.0
        self.add_after(name, delay, "retry")
        return delay

    def forget(self, name: str) -> None:
        """The name's work succeeded: its next failure waits the shortest backoff again."""
        with self._cond:
            self._failures.pop(name, None)

    def get(self, timeout: float | None = None) -> tuple[str, frozenset[Hashable]] | None:
        """The next name to work on, with the reasons it was added for; the caller must call
        `done` with it. None once shut down, or when `timeout` passed with nothing ready."""
        with self._cond:
            end = None if timeout is None else self._monotonic() + timeout
            while not self._shut:
                now = self._monotonic()
                self._promote(now)
                if self._ready:
                    name = self._ready.popleft()
                    self._queued.discard(name)
                    self._processing.add(name)
                    return name, frozenset(self._reasons.pop(name, ()))
                waits = [w for w in (self._next_deadline(), end) if w is not None]
                if end is not None and now >= end:
                    return None
                self._cond.wait(min(waits) - now if waits else None)
            return None

    def _promote(self, now: float) -> None:
        while self._waiting and self._waiting[0][0] <= now:
            when, _, name = heapq.heappop(self._waiting)
            if self._earliest.get(name) == when:
                del self._earliest[name]
                for reason in self._later.pop(name, ()):
                    self._reasons.setdefault(name, set()).add(reason)
                self._add(name, None)

    def _next_deadline(self) -> float | None:
        return self._waiting[0][0] if self._waiting else None

    def done(self, name: str) -> None:
        """The worker is through with the name: added meanwhile, it is queued again."""
        with self._cond:
            self._processing.discard(name)
            if name in self._again:
                self._again.discard(name)
                self._add(name, None)

    def shut_down(self) -> None:
        """Workers' `get` returns None from now on; nothing more is queued."""
        with self._cond:
            self._shut = True
            self._cond.notify_all()

    def __len__(self) -> int:
        """Names queued now (not those waiting for a deadline, nor those being processed)."""
        with self._cond:
            return len(self._ready)
