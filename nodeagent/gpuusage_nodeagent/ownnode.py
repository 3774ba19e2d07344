"""What the agent's own Node says of its driver (see driverupgrade), read at most once every
--driver-upgrade-read-every.

A GET of one Node with resourceVersion=0 is answered from the apiserver's watch cache, not from
etcd, and reading it every 30 s costs 5,000 nodes about 170 cached reads a second, a third of
what their kubelets' 10 s Lease renewals write. A watch would hear a change sooner but holds one
more connection per node open on the apiserver for the agent's whole life, and the agent's
single-threaded REST client would need a thread of its own for it. The price of the interval: a
driver manager that finds the module still in use within it (no GPU pod's termination grace
delayed it) fails its unload and retries after its restart backoff. Where that retry may
again be short (the driver manager alone sets `paused-for-` and, when its unload fails, `true`
again), the Node is read every WATCHFUL_EVERY for WATCHFUL_FOR after the last pause seen: only
nodes that just paused pay for it, and the agent lets go between two cycles (see releasing).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from gpuusage.kube.errors import ApiError
from gpuusage_nodeagent.driverupgrade import UPGRADE_STATE_LABEL, releasing

log = logging.getLogger(__name__)

WATCHFUL_EVERY = timedelta(seconds=2)
"""How often the Node is read soon after a pause (never less often than --driver-upgrade-read-
every says)."""
WATCHFUL_FOR = timedelta(minutes=10)
"""How long after the last pause seen the Node is read that often: the driver manager's restart
backoff grows to 5 minutes between two tries."""


class UpgradeWatch:
    """What on the agent's Node asks it to let go of the driver (see driverupgrade), if any.

    A failed read keeps the last answer read (none before the first): an agent that cannot read
    its Node neither lets go of the driver nor takes it back on a guess.
    """

    def __init__(
        self,
        get: Callable[[str], dict[str, Any]],
        node_name: str,
        *,
        every: timedelta,
        clock: Callable[[], datetime],
        label: str = UPGRADE_STATE_LABEL,
    ) -> None:
        self._get = get
        self.path = f"/api/v1/nodes/{urllib.parse.quote(node_name, safe='')}?resourceVersion=0"
        self._every = every
        self._clock = clock
        self.label = label
        self._read_at: datetime | None = None
        self._paused_at: datetime | None = None
        self._state: str | None = None
        self._failure: str | None = None

    def _interval(self, now: datetime) -> timedelta:
        watchful = self._paused_at is not None and now - self._paused_at < WATCHFUL_FOR
        return min(self._every, WATCHFUL_EVERY) if watchful else self._every

    def state(self) -> str | None:
        """`label=value` of the label that asks the agent to let go of the driver, or None."""
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self._interval(now):
            return self._state
        self._read_at = now
        try:
            node = self._get(self.path)
        except ApiError as exc:
            if str(exc) != self._failure:  # a lasting failure once
                self._failure = str(exc)
                log.error("reading the agent's Node failed: %s (its last state is kept)", exc)
            return self._state
        self._failure = None
        labels = (node.get("metadata") or {}).get("labels") or {}
        state = releasing(labels, self.label)
        if state != self._state:
            log.info("Node labels: %s", state or "none asks the agent to let go of the driver")
        self._state = state
        if state is not None:
            self._paused_at = now
        return state
