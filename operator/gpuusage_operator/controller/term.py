"""Everything a replica remembers for its leadership term (see ha.terms: why one object).

Each piece names its one user. What is not here is not the term's: the watches' caches (pods,
reports, claims, Leases, policies with their status), the work queue, the policies' decisions
waiting to be written, the budgets of writes and the counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from gpuusage_operator.controller.reportbook import ReportBook
from gpuusage_operator.ha.terms import Terms
from gpuusage_operator.judge.freshness import Sighting
from gpuusage_operator.openreports.writer import Listing
from gpuusage_operator.policies.noderun import NodeMemory
from gpuusage_operator.writers.eventbook import EventBook
from gpuusage_operator.writers.podmarker import MarkMemory


@dataclass(eq=False)
class Term:
    """One term's memories; a new term starts with all of them empty."""

    book: ReportBook = field(default_factory=ReportBook)
    """What each report's last reconcile judged and wrote, its echo among it (the
    reconciler's, see reportbook)."""
    sightings: dict[str, Sighting] = field(default_factory=dict)
    """Each report's signs of life and the staleness verdict in force (the liveness's)."""
    absent: dict[str, datetime] = field(default_factory=dict)
    """Pod UID → since when a pod marked in use showed none of its processes (the
    reconciler's, for the judge)."""
    seen_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Pod UID → the devices it was last judged using (the reconciler's, for the judge)."""
    marks: MarkMemory = field(default_factory=MarkMemory)
    """What was written on each pod (the pod marker's)."""
    events: EventBook = field(default_factory=EventBook)
    """The Events' series and rates (the Event recorder's)."""
    nodes: NodeMemory = field(default_factory=NodeMemory)
    """The Nodes' marks read and the node decisions recorded (the node runner's)."""
    openreports: Listing = field(default_factory=Listing)
    """The OpenReports as last listed or written (their writer's)."""


def new_terms() -> Terms[Term]:
    return Terms(Term)
