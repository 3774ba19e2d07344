"""Whether the Kubernetes API answers, said once when it stops and once when it is back.

An apiserver whose etcd is down still accepts connections and keeps watches open: nothing
fails loudly, and before this the operator logged nothing for as long as the outage lasted.
Every part that talks to the API reports here (the pod watch, a probe of the staleness watch),
and the transitions are logged once each, with the outage's length, however many calls fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class ApiHealth:
    """Outage bookkeeping shared by threads; `clock` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self.failures = 0

    @property
    def available(self) -> bool:
        return self._down_since is None

    def failed(self, what: str, error: object) -> None:
        with self._lock:
            self.failures += 1
            if self._down_since is not None:
                return
            self._down_since = self._clock()
        log.warning("Kubernetes API unavailable (%s: %s); retrying until it is back", what, error)

    def succeeded(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            lasted = self._clock() - self._down_since
            self._down_since = None
        log.warning("Kubernetes API available again after %.0fs", lasted)
