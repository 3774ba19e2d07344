"""The cluster-wide budget of pod writes. Pure, with the clock passed in.

Every pod write, across all reports and the policies' steps, draws from one token bucket
(client-go's rate limiter is the model): a burst is allowed, then `rate` a second; a write over
the budget waits for the next reconcile of its report instead of being sent. One node's agent
rewriting its report as fast as it likes thus never writes tenants' pods at its pace.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

DEFAULT_WRITE_RATE = 50.0
"""Pod writes a second, cluster-wide, once the burst is spent."""
DEFAULT_WRITE_BURST = 500


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
