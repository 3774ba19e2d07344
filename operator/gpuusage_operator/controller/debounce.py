"""How often one report may be reconciled, and the cluster-wide budget of pod writes. Pure,
with the clock passed in.

An agent may rewrite its report as fast as it likes (a bug, or a compromised node): each
rewrite is an event, and a reconcile per event would let one node drive the operator into
writing tenants' pods and Events at the agent's pace. So a report is reconciled at most once
per `interval`; events that come sooner are held, and the report's latest version is
reconciled once the interval has passed (one deferred reconcile per report, however many
events came). Pod writes, across all reports, draw from a token bucket (client-go's rate
limiter is the model): a burst is allowed, then `rate` a second; a write over the budget waits
for the next reconcile of its report instead of being sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

DEFAULT_INTERVAL = 1.0
"""Seconds between two reconciles of one report at most."""
DEFAULT_WRITE_RATE = 50.0
"""Pod writes a second, cluster-wide, once the burst is spent."""
DEFAULT_WRITE_BURST = 500


@dataclass
class Debounce:
    """When each report was last reconciled: an event within the interval waits for the rest
    of it (the work queue merges every event meanwhile into one reconcile of the latest)."""

    interval: float = DEFAULT_INTERVAL
    _last: dict[str, float] = field(default_factory=dict)

    def wait(self, name: str, now: float) -> float:
        """Seconds before this report may be reconciled again (0: now)."""
        last = self._last.get(name)
        return 0.0 if last is None else max(0.0, last + self.interval - now)

    def ran(self, name: str, now: float) -> None:
        """A reconcile of this report starts now."""
        self._last[name] = now

    def forget(self, name: str) -> None:
        """The report is gone."""
        self._last.pop(name, None)

    def __len__(self) -> int:
        return len(self._last)


@dataclass
class WriteBudget:
    """A token bucket: `burst` writes at once, refilled at `rate` a second. Shared by the
    workers' threads: each take reads and spends under one lock."""

    rate: float = DEFAULT_WRITE_RATE
    burst: int = DEFAULT_WRITE_BURST
    _tokens: float | None = None
    _at: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def take(self, now: float, writes: int = 1) -> bool:
        """Whether these writes may go now (and spend them): all or none, so that a pod's
        annotations and condition never go one without the other."""
        with self._lock:
            tokens = float(self.burst) if self._tokens is None else self._tokens
            if self._at is not None:
                tokens = refilled(tokens, now - self._at, self.rate, self.burst)
            self._at = now
            if tokens < writes:
                self._tokens = tokens
                return False
            self._tokens = tokens - writes
            return True


def refilled(tokens: float, seconds: float, rate: float, burst: int) -> float:
    """The tokens after `seconds` of refilling at `rate`, never more than `burst`."""
    return min(float(burst), tokens + seconds * rate)
