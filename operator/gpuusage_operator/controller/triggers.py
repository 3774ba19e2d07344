"""Why a report is queued, and how the watches queue it.

The watches (pods, Leases, policies) and the writers never call into the reconciler: they
queue the name of a report (reports are named after their nodes) with a reason, and a worker
reads what changed from the caches when it takes the name (see controller.workers). Some
reasons always ask for a reconcile; the others only when what they point at matters to the
report, which the reconciler judges when a worker takes them (Reconciler.needs_reconcile):

* EVENT: the report was added, changed or deleted (the worker reads it from the report
  watch's cache, see informers.reportwatch);
* DUE: a pod started or stopped holding GPUs on the node, a Lease appeared or went, a
  policy changed, a pod's writes waited for the budget or failed;
* DEADLINE: one of the report's judgements comes due (idle time, marks settling, a notice);
* STALENESS, RENEWED: the report may have turned stale, or its agent's Lease was renewed (a
  stale report may be fresh again; see liveness, which queues both): reconciled only when its
  freshness differs from the verdict in force;
* Edited: a pod's gpuusage.io/ marks changed: reconciled unless that is the echo of our write;
* Gone: a pod was deleted: reconciled when the report's status lists it (its memory of the
  pod is dropped either way).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuusage_operator.controller.reportbook import ReportBook
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.index.pods import PodSnapshot

EVENT, DUE, DEADLINE, STALENESS, RENEWED = "event", "due", "deadline", "staleness", "renewed"
FRESHNESS = frozenset({STALENESS, RENEWED})
"""The reasons that ask only whether the report's freshness changed."""


@dataclass(frozen=True)
class Edited:
    """A pod's marks changed, as this version of the pod shows them."""

    uid: str
    version: str | None


@dataclass(frozen=True)
class Gone:
    """A pod was deleted."""

    uid: str


def gone_pods(reasons: Iterable[Hashable]) -> set[str]:
    """The UIDs of the deleted pods among the reasons."""
    return {reason.uid for reason in reasons if isinstance(reason, Gone)}


@dataclass(frozen=True)
class Triggers:
    """How the watches and writers queue reports: only names and reasons, nothing else."""

    queue: WorkQueue
    book: Callable[[], ReportBook]
    """What is remembered of the reports in this term: read only, to leave out the echoes of
    our own status writes."""
    echoed: Callable[[], None] = field(default=lambda: None)
    """Counts a report event left out as our own write's echo (for the metrics)."""

    def report_changed(self, name: str, report: Mapping[str, Any] | None) -> None:
        """The report watch showed the report added, changed or (None) deleted. A change that
        shows the report exactly as our last reconcile left it only echoes our own status
        write: reconciling it would find nothing to do at the price of a full reconcile. An
        echo that comes before that reconcile has recorded its write is queued, and the worker
        tells it apart when it takes the name (see workers)."""
        if report is not None and self.book().is_echo(report):
            self.echoed()
            return
        self.queue.add(name, EVENT)

    def reports_listed(self, names: Iterable[str]) -> None:
        """A list of the reports found these changed or gone since the last (every report at
        the first list)."""
        for name in names:
            self.queue.add(name, EVENT)

    def due(self, nodes: Iterable[str]) -> None:
        """These reports are to be reconciled without an event of their own (any thread)."""
        for node in nodes:
            self.queue.add(node, DUE)

    def marks_edited(self, pod: PodSnapshot) -> None:
        """The pod's gpuusage.io/ annotations or GPUInUse condition changed. Whether that is
        the echo of our own write is judged when the name is taken: the echo may come before
        the write's answer."""
        if pod.node:
            self.queue.add(pod.node, Edited(pod.uid, pod.resource_version))

    def pod_gone(self, node: str, uid: str) -> None:
        """A pod of the node was deleted."""
        self.queue.add(node, Gone(uid))
