"""The node agents' Leases, kept by an informer in the agents' namespace (never a read per
report), and what the operator saw of their renewals, by its own clock.

What was seen outlives the informer's lists: a list after an interruption finds each Lease as
it is now, and only a renewTime different from the one last seen counts as a renewal (seen at
that moment), so a relist never makes a dead agent look alive. Leases whose holder is not a
gpuusage agent are ignored. Without a namespace to watch, or without permission to read Leases
(an older install's RBAC), nothing is known of Leases: the reports' own rewrites show liveness,
and the reason is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api import names
from gpuusage.api.times import Clock, utc_now
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import (
    WATCH_IDLE,
    Informer,
    OptionalWatch,
    watch_kwargs,
)
from gpuusage_operator.judge.freshness import Renewal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Seen:
    renew_time: str | None
    seen_at: datetime
    witnessed: bool
    duration: timedelta | None = None
    """The Lease's leaseDurationSeconds: how long its holder vouches for itself."""


def lease_duration(spec: Mapping[str, Any]) -> timedelta | None:
    """A Lease's leaseDurationSeconds as a duration (None: absent or not a positive number)."""
    seconds = spec.get("leaseDurationSeconds")
    if isinstance(seconds, int) and not isinstance(seconds, bool) and seconds > 0:
        return timedelta(seconds=seconds)
    return None


class LeaseState:
    """The Leases present now; what was seen of them lives in the shared `memory`."""

    def __init__(
        self,
        memory: dict[str, Seen],
        clock: Clock,
        on_news: Callable[[set[str]], None],
        on_renewed: Callable[[str], None] = lambda name: None,
    ) -> None:
        self._memory = memory
        self._clock = clock
        self._on_news = on_news
        self._on_renewed = on_renewed
        self._names: set[str] = set()

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        spec = obj.get("spec") or {}
        if event_type == "DELETED" or not str(spec.get("holderIdentity") or "").startswith(
            names.LEASE_HOLDER_PREFIX
        ):
            self._names.discard(name)
            if self._memory.pop(name, None) is not None:
                self._on_news({name})
            return
        self._names.add(name)
        renew, duration = spec.get("renewTime"), lease_duration(spec)
        known = self._memory.get(name)
        if known is None:
            self._memory[name] = Seen(renew, self._now(), witnessed=False, duration=duration)
            self._on_news({name})
        elif known.renew_time != renew:
            self._memory[name] = Seen(renew, self._now(), witnessed=True, duration=duration)
            self._on_renewed(name)
        elif known.duration != duration:  # a new duration changes when the node turns stale
            self._memory[name] = Seen(renew, known.seen_at, known.witnessed, duration)
            self._on_news({name})

    def _now(self) -> datetime:
        return self._clock().replace(microsecond=0)  # as the status keeps times

    def ids(self) -> set[str]:
        return set(self._names)

    def __len__(self) -> int:
        return len(self._names)


class LeaseWatch(OptionalWatch):
    """Watches the Leases of one namespace; `renewal(node)` says what was seen of a node's.
    `on_news` hears the nodes whose Lease appeared or went (what their reports' freshness is
    judged by changed, with no event of the report's own), `on_renewed` each renewal (a stale
    report may be fresh again)."""

    def __init__(
        self,
        coordination: Any,
        namespace: str,
        *,
        clock: Clock = utc_now,
        health: ApiHealth | None = None,
        on_news: Callable[[set[str]], None] = lambda nodes: None,
        on_renewed: Callable[[str], None] = lambda name: None,
        idle_timeout: float = WATCH_IDLE,
    ) -> None:
        self.namespace = namespace
        self._on_news, self._on_renewed, self._clock = on_news, on_renewed, clock
        self._memory: dict[str, Seen] = {}
        self._listed_at = clock().replace(microsecond=0)
        """When the watch's latest list began: before it, renewals could not be seen."""
        self.informer: Informer[LeaseState] = Informer(
            "lease",
            lambda limit, token: coordination.list_namespaced_lease(
                namespace, limit=limit, _continue=token, _preload_content=False
            ),
            lambda version, idle: coordination.list_namespaced_lease(
                namespace, **watch_kwargs(version, idle)
            ),
            self._new_state,
            health=health,
            on_listed=self._forget,
            idle_timeout=idle_timeout,
        )
        super().__init__(
            [self.informer],
            lambda: coordination.list_namespaced_lease(namespace, limit=1, _preload_content=False),
            f"the agents' Leases in {namespace} cannot be read (%s): liveness from reports only",
        )

    def _new_state(self) -> LeaseState:
        """The state a list fills (each list, the first and every one after an interruption,
        starts one): the moment is when renewals could be seen again."""
        self._listed_at = self._clock().replace(microsecond=0)
        return LeaseState(self._memory, self._clock, self._on_news, self._on_renewed)

    def _forget(self, before: LeaseState, after: LeaseState) -> None:
        """Leases gone while the watch was interrupted (found missing by a new list)."""
        missing = before.ids() - after.ids()
        gone = {name for name in missing if self._memory.pop(name, None) is not None}
        if gone:
            self._on_news(gone)

    def probe(self) -> bool:
        if not self.namespace:
            log.info("no Lease namespace (--lease-namespace, POD_NAMESPACE): liveness from reports")
            return False
        return super().probe()

    def renewal(self, node: str) -> Renewal | None:
        """What was seen of the node's Lease. While the watch is interrupted, and until a
        renewal is seen after it lists again, renewals could not be seen: the agent is given
        from the latest list on to show one (neither a renewal nor its absence is known of
        the time the operator could not watch: its own blind spell is not the node's). Such a
        floor is no witnessed renewal, so it never makes a report already stale fresh again.
        Every list grants it, a list after an expired watch too: staleness comes at most one
        duration later for it."""
        seen = self._memory.get(node)
        if seen is None or not self.available.is_set():
            return None
        lease = f"{self.namespace}/{node}"
        since = self._listed_at
        if not self.informer.synced.is_set() or seen.seen_at < since:
            return Renewal(lease, max(seen.seen_at, since), False, seen.duration)
        return Renewal(lease, seen.seen_at, seen.witnessed, seen.duration)
