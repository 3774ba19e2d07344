"""What this replica remembers of each report between its reconciles, in one record per report.

The reconcile of a report creates its record and replaces it whole, once, at its end; only the
report's deletion drops it (Reconciler.forget_node). The book is the term's (controller.term):
in a new term no report is taken for judged, nor an event for the echo of its write. Its signs
of life are not here: they are the Liveness's (see liveness). Other threads (the metrics, the
policy watch, the workers judging a reason) read records without a lock: a record is never
changed in place, and readers copy the table before walking it.
"""

from __future__ import annotations

import threading
from collections import Counter as TallyCounter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuusage.api.models import OrphanedMemory
from gpuusage_operator.index.pods import PodSnapshot


@dataclass(frozen=True, slots=True)
class ReportMemory:
    """What this replica remembers of one report."""

    stale: bool = False
    """Whether the status our last reconcile judged says stale (when it goes stale is the
    Liveness's to say, see liveness)."""
    echo: str | None = None
    """The resourceVersion our last status write gave it, when that reconcile wrote everything
    it wanted: the watch event of that version only echoes our own write."""
    listing: frozenset[str] = frozenset()
    """The UIDs of the pods its status lists."""
    unattributed: TallyCounter[str] = field(default_factory=TallyCounter)
    """Its processes that belong to no pod, by reason (for the metrics)."""
    judged_whole: bool = False
    """A reconcile judged it whole: what follows is its status's word (for the OpenReports)."""
    orphaned: OrphanedMemory | None = None
    """GPU memory no live pod holds, as its status says."""
    blind: tuple[tuple[str, str], ...] = ()
    """(device UUID, reason) of each device its status says it cannot show whole."""
    unmarked: tuple[PodSnapshot, ...] = ()
    """Its pods that carry none of our marks (outside the operator's scope, or inside with
    none written yet; see scope), each with the marks it would carry: what the judge remembers
    of them at the next reconcile, and their findings, for the OpenReports, where no pod shows
    them."""


class ReportBook:
    """Report name → its ReportMemory."""

    def __init__(self) -> None:
        self._reports: dict[str, ReportMemory] = {}
        self._lock = threading.Lock()
        """Held by every writer; readers read without it."""

    def get(self, name: str) -> ReportMemory | None:
        return self._reports.get(name)

    def put(self, name: str, memory: ReportMemory) -> None:
        with self._lock:
            self._reports[name] = memory

    def drop(self, name: str) -> None:
        with self._lock:
            self._reports.pop(name, None)

    def names(self) -> set[str]:
        """Every report reconciled since start (what a policy's node rules may concern: a
        policy that comes, changes or goes reaches nodes whose pods carry no mark too)."""
        return set(self._reports)

    def is_echo(self, body: Mapping[str, Any]) -> bool:
        """Whether a watch event shows the report exactly as our last reconcile left it.

        Every status write comes back as a watch event. Reconciling it again would find nothing
        to do at the price of a full reconcile (a large share of the operator's CPU per report
        update; see benchmarks/README.md). Only watch events may be skipped so: a reconcile
        for a later time (staleness) must run even on the same version.
        """
        meta = body["metadata"]
        version = meta.get("resourceVersion")
        memory = self._reports.get(meta["name"])
        return version is not None and memory is not None and memory.echo == version

    def judged_whole(self) -> dict[str, ReportMemory]:
        """The reports a reconcile has judged whole, by name."""
        return {name: m for name, m in list(self._reports.items()) if m.judged_whole}

    def lists(self, name: str, uid: str) -> bool:
        """Whether the report's status lists this pod."""
        memory = self._reports.get(name)
        return memory is not None and uid in memory.listing

    def unattributed(self) -> list[TallyCounter[str]]:
        """Each remembered report's processes that belong to no pod, by reason."""
        return [memory.unattributed for memory in list(self._reports.values())]
