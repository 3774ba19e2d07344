"""When does a node go stale? The one object that answers it.

It holds each node's signs of life as this replica saw them: its report's changes (a
Sighting, see judge.freshness) and its agent's Lease renewals (read from the Lease watch, see
informers.leasewatch), the verdict in force (stale or fresh, as the last reconcile judged it: what
its status says), and so when a fresh node turns stale. The watches tell it (`renewed`); a
reconcile asks it once for the report's freshness (`judge`), which records the verdict under
the same lock as it reads the renewal: a renewal told after that finds the verdict it can
change, and is queued (RENEWED), so none is lost between a judgement and the status write.
The workers ask it whether a staleness reason matters (`flipped`); it queues each fresh
node for the moment it would turn stale (`watch`). The rule itself is judge.freshness's, pure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

from gpuusage.api.models import GpuNodeUsageStatus
from gpuusage_operator.controller.triggers import RENEWED, STALENESS
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.judge.freshness import (
    MAX_CLOCK_SKEW,
    Freshness,
    Renewal,
    Sighting,
    freshness,
    sight,
    threshold,
)

STALE_MARGIN = 0.05
"""Seconds past the moment a report would turn stale (is_stale: strictly older)."""
Renewals = Callable[[str], Renewal | None]
"""A node → its agent's Lease as the operator saw it renewed (None: no Lease known)."""


class Liveness:
    """Each node's signs of life and its staleness verdict (see the module's docstring)."""

    def __init__(
        self,
        queue: WorkQueue,
        *,
        stale_after: timedelta | None = None,
        sightings: Callable[[], dict[str, Sighting]],
        renewals: Renewals = lambda node: None,
    ) -> None:
        self._queue = queue
        self.stale_after = stale_after
        """--stale-after; None: each node by its agent's Lease's duration (see threshold)."""
        self._renewals = renewals
        self._sightings = sightings
        """Report name → its sighting; `stale` is the verdict in force. The term's
        (controller.term): a new term sees each report afresh, as at start, from what its
        status says (see freshness.sight)."""
        self._lock = threading.Lock()

    def renewed(self, node: str) -> None:
        """The node's agent renewed its Lease (the Lease watch, once its state shows it). Only
        a node judged stale can be changed by that (a renewal never makes one stale), and every
        agent renews every 20 s: queueing the others would wake a worker for nothing at every
        renewal of every node (benchmarks/lease_events.py)."""
        with self._lock:
            seen = self._sightings().get(node)
            if seen is not None and seen.stale:
                self._queue.add(node, RENEWED)

    def judge(
        self,
        name: str,
        generation: int | None,
        observed_at: datetime,
        status: GpuNodeUsageStatus | None,
        now: datetime,
    ) -> Freshness:
        """The report's freshness now, having seen it at `generation` (see freshness.sight);
        the verdict is in force from here on."""
        with self._lock:
            renewal = self._renewals(name)
            limit = threshold(self.stale_after, renewal)
            sightings = self._sightings()
            seen = sight(
                sightings.get(name), generation, observed_at, status, now, stale_after=limit
            )
            fresh = freshness(seen, renewal, self.stale_after, now)
            sightings[name] = replace(seen, stale=fresh.stale)
            return fresh

    def _now(self, name: str, now: datetime) -> tuple[Sighting, Freshness] | None:
        seen = self._sightings().get(name)
        if seen is None:
            return None
        return seen, freshness(seen, self._renewals(name), self.stale_after, now)

    def flipped(self, name: str, now: datetime) -> bool:
        """Whether the report's freshness by `now` differs from the verdict in force."""
        with self._lock:
            found = self._now(name, now)
        return found is not None and found[1].stale != found[0].stale

    def deadline(self, name: str, now: datetime) -> datetime | None:
        """When a report judged fresh turns stale if no sign of life comes (a dead agent
        writes nothing, so no event says it); None for one judged stale or never judged."""
        with self._lock:
            found = self._now(name, now)
        if found is None or found[0].stale:
            return None
        return found[1].turns_stale

    def watch(self, name: str, now: datetime) -> None:
        """A fresh report turns stale with no event (a dead agent writes nothing): its name is
        queued for when it would, with the reason STALENESS (the worker asks `flipped`: a Lease
        renewed meanwhile may have kept it fresh, and then comes here again)."""
        turns = self.deadline(name, now)
        if turns is not None:
            delay = (turns - now).total_seconds() + STALE_MARGIN
            self._queue.add_after(name, delay, STALENESS)

    def forget(self, name: str) -> None:
        """The report is gone."""
        with self._lock:
            self._sightings().pop(name, None)

    def clock_skews(self) -> dict[str, float]:
        """Reports whose agent's clock is off by more than MAX_CLOCK_SKEW: seconds, by name."""
        with self._lock:
            skews = {name: seen.skew for name, seen in self._sightings().items()}
        return {
            name: skew.total_seconds()
            for name, skew in skews.items()
            if skew is not None and abs(skew) > MAX_CLOCK_SKEW
        }
