"""Apply what the pure core wants: GpuNodeUsage status, pod annotations, pod condition, Events.

One idempotent reconcile per report, run on one of the workers' threads (controller.workers;
the `kubernetes` client is synchronous): judge_report judges the report, writers.podmarker writes
the pods, writers.statuswriter the status; this room keeps the order of the writes, what each
reconcile leaves in the report's memory (see reportbook) and when the report is next due, and
judges whether what a report was queued for asks for a reconcile at all (see triggers). Writes
happen only
where the desired state differs from what is known: the pod index (our annotations and
condition are part of each entry) or, after our own writes, a last-applied cache that covers
the moment before the watch delivers them. The cache is trusted only while the index shows a
resourceVersion this replica produced or saw before writing: once anyone else changes the pod
(another replica after a failover, a person removing an annotation) the index wins. An
unchanged report therefore costs no write at all, and nothing a replica remembers can mask
what is really on the pod. One pod failing (deleted meanwhile: 404) never stops the rest.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as TallyCounter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from typing import Any

from kubernetes import client
from pydantic import ValidationError

from gpuusage.api.models import GpuNodeUsageSpec, GpuNodeUsageStatus
from gpuusage_operator.controller.liveness import Liveness
from gpuusage_operator.controller.reportbook import ReportBook, ReportMemory
from gpuusage_operator.controller.scope import (
    Scope,
    as_carried,
    judged_lookup,
    mark_outside,
)
from gpuusage_operator.controller.term import Term, new_terms
from gpuusage_operator.controller.triggers import (
    DEADLINE,
    FRESHNESS,
    Edited,
    Gone,
)
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.ha.terms import Terms
from gpuusage_operator.index.dra import NO_DRA, DraLookup
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.findings import observe
from gpuusage_operator.judge.freshness import (
    Renewal,
)
from gpuusage_operator.judge.idle import DEFAULT_IDLE_AFTER
from gpuusage_operator.judge.podstate import Verdict
from gpuusage_operator.judge.report import JudgeSettings, judge_report
from gpuusage_operator.judge.requests import DEFAULT_RULES, AllocationRules
from gpuusage_operator.judge.resolution import DEFAULT_DRIVER_NAMESPACES
from gpuusage_operator.judge.restarts import RESTART_GRACE
from gpuusage_operator.policies.noderun import NodeRunner
from gpuusage_operator.policies.run import PolicyRunner
from gpuusage_operator.writers.marks import would_carry
from gpuusage_operator.writers.podmarker import PodMarker
from gpuusage_operator.writers.statuswriter import echo_version, write_status

log = logging.getLogger(__name__)

UNKNOWN_NAMESPACE_RETRY = timedelta(seconds=2)
"""How soon a report with a pod whose namespace the namespace watch has not brought yet (one
created a moment ago) is judged again, to mark it or not."""


@dataclass
class Counts:
    """Writes made; the benchmark and the zero-write tests read these."""

    reconciles: int = 0
    """Reports reconciled (also those that needed no write): the sign that the operator looked."""
    status_writes: int = 0
    status_conflicts: int = 0
    """Status writes of only what changed that were refused because the report had changed
    since it was read (then the whole status was sent)."""
    pod_writes: int = 0
    events: int = 0
    """Events created, and series of identical ones updated."""
    events_dropped: int = 0
    """Events not written: their object's rate was spent (see eventbook)."""
    openreport_writes: int = 0
    """OpenReports created, replaced and deleted (see openreports)."""
    openreport_errors: int = 0
    """OpenReports writes that did not land (tried again at the next pass)."""
    uid_refusals: int = 0
    """Pod writes the apiserver refused because the pod of that name had another UID."""
    writes_deferred: int = 0
    """Pods whose writes waited for a later reconcile: the cluster-wide budget was spent."""
    marks_removed: int = 0
    """Pods whose gpuusage marks were taken off: outside the operator's scope (see scope)."""
    echoes_skipped: int = 0
    """Report events left out: they only echoed our own status write (see triggers)."""
    api_errors: TallyCounter[str] = field(default_factory=TallyCounter)
    """Pod write failures by kind (NotFound is no failure: the pod went away meanwhile)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """The workers' threads count at once: each count is changed under it (readers, the
    metrics and the tests, read a whole int, which needs none)."""

    def add(self, name: str, n: int = 1) -> None:
        if name not in _COUNT_NAMES:
            raise ValueError(f"no count named {name!r}")
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def failed(self, kind: str) -> None:
        """A pod write failed with this kind of error."""
        with self._lock:
            self.api_errors[kind] += 1

    @property
    def pod_errors(self) -> int:
        return sum(self.api_errors.values())

    @property
    def pod_writes_missed(self) -> int:
        """Pod writes that did not land: failures and refusals for another UID."""
        return self.pod_errors + self.uid_refusals


_COUNT_NAMES = frozenset(f.name for f in fields(Counts) if f.type == "int")
"""The counts `add` may add to: Counts' int fields."""


@dataclass
class Reconciler:
    """Reconciles one report at a time with what it is handed, built complete: the writers, the
    queue its deadlines go to, the policy runners, the Leases' renewals."""

    api: client.ApiClient
    marker: PodMarker
    """Writes the pods and their Events (see writers.podmarker)."""
    counts: Counts
    """The tallies the marker and its Event recorder keep too."""
    queue: WorkQueue
    """Every reason to reconcile a report, by its name (see workqueue, reasons): the operator's
    workers take them one report at a time, so two reconciles of one report never run at once
    (both would decide from the same pod state and both write: two start Events)."""
    terms: Terms[Term] = field(default_factory=new_terms)
    """What this replica remembers for its leadership term (see controller.term): the marker,
    the Event recorder and the node runner are handed their parts of it where they are built
    (main.Operator)."""
    stale_after: timedelta | None = None
    """--stale-after; None: each node by its agent's Lease's duration, else three minutes
    (see freshness.threshold)."""
    idle_after: timedelta | None = DEFAULT_IDLE_AFTER
    """How long requested GPUs may go unused before the pod is flagged; None: never."""
    restart_grace: timedelta = RESTART_GRACE
    """How long after a container's exit its pod's missing use is a restart (see restarts)."""
    rules: AllocationRules = DEFAULT_RULES
    """What counts as handing a pod a GPU (see allocation)."""
    driver_namespaces: frozenset[str] = frozenset(DEFAULT_DRIVER_NAMESPACES)
    """Where NVIDIA's daemons (the MPS server) run as pods (see resolution)."""
    policies: PolicyRunner | None = None
    """Carries out the GpuUsagePolicies about the pods each reconcile judges (None: none)."""
    nodes: NodeRunner | None = None
    """Carries out the policies' node rules about each reconciled node (None: none)."""
    scope: Scope = field(default_factory=Scope)
    """Where the operator writes on pods (see scope): by default, on every pod."""
    renewals: Callable[[str], Renewal | None] = field(default=lambda node: None)
    """A node agent's Lease as the operator saw it renewed (see informers.leasewatch); by
    default none is known, and freshness comes from the reports alone."""
    reports_api: Any = None
    """Where report statuses are written (a kubernetes CustomObjectsApi); by default one on
    `api`. Tests pass a stand-in that answers as the apiserver does."""

    def __post_init__(self) -> None:
        self._custom = self.reports_api or client.CustomObjectsApi(self.api)
        self.liveness = Liveness(
            self.queue,
            stale_after=self.stale_after,
            renewals=self.renewals,
            sightings=lambda: self.terms.current.sightings,
        )
        """When each node goes stale (see liveness): the one owner of its signs of life."""
        self._judge_settings = JudgeSettings(
            self.rules,
            self.driver_namespaces,
            self.idle_after,
            self.restart_grace,
        )

    @property
    def book(self) -> ReportBook:
        """What this replica remembers of each report in this term (see reportbook)."""
        return self.terms.current.book

    # -- reports ---------------------------------------------------------------------------
    def reconcile(
        self, body: dict[str, Any], lookup: PodLookup, now: datetime, dra: DraLookup = NO_DRA
    ) -> bool:
        """Bring status and pods in line with one report; True when the report is stale.
        `dra` tells what the pods' claims got (by default nothing is known of claims). One
        at a time per report: the queue's workers call it (tests, alone)."""
        name = body["metadata"]["name"]
        self.counts.add("reconciles")
        missed = self.counts.pod_writes_missed
        written: str | None = None
        try:
            spec = GpuNodeUsageSpec.model_validate(body.get("spec") or {})
            previous = (
                GpuNodeUsageStatus.model_validate(body["status"]) if body.get("status") else None
            )
        except ValidationError as exc:
            log.error("GpuNodeUsage %s cannot be read: %s", name, exc)
            return False
        generation = body["metadata"].get("generation")
        term = self.terms.current  # (what a term that begins meanwhile no longer needs)
        fresh = self.liveness.judge(name, generation, spec.observed_at, previous, now)
        last = term.book.get(name)
        before = {p.uid: p for p in last.unmarked} if last is not None else {}
        decision = judge_report(
            spec,
            previous,
            generation=generation,
            fresh=fresh,
            lookup=judged_lookup(lookup, self.scope, before, previous, now),
            dra=dra,
            now=now,
            settings=self._judge_settings,
            absent=term.absent,
            seen_on=term.seen_on,
        )
        unattributed: TallyCounter[str] = TallyCounter(
            r.reason for r in decision.resolutions if r.reason
        )
        status, stale = mark_outside(decision.status, self.scope), decision.status.stale
        wake = list(decision.wake)
        # Pods first: their annotations and condition are what people read, and each write
        # waits on the apiserver; the status follows.
        unmarked: list[PodSnapshot] = []
        for verdict in decision.verdicts:
            remember(term, verdict)
            writes = self.scope.writes(verdict.pod.namespace)
            if writes is None:  # its namespace not known yet: left as it is, on no guess
                wake.append(now + UNKNOWN_NAMESPACE_RETRY)
                continue
            as_is = lookup.by_uid(verdict.pod.uid)  # the pod as it is, not as judged
            if not writes or (as_is is not None and not as_is.marked):
                # what the judge remembers of a pod that carries none of our marks, for the
                # next reconcile (see scope.JudgedMarks)
                carried = would_carry(verdict, before.get(verdict.pod.uid), now)
                unmarked.extend([carried] if carried is not None else [])
            if not writes:
                self._unmark(as_is)
                continue
            if verdict.settles_until is not None:
                continue  # as it is until then (decision.wake has the time)
            shown = replace(verdict, pod=as_carried(verdict.pod, as_is))
            marked = self.marker.mark(shown, spec.node_name, now)
            if marked is not None and marked.due is not None:
                wake.append(marked.due)  # its detail, held back until then
            if self.policies is not None and marked is not None:  # acted on once stated
                seen = observe(verdict.state, verdict.judgement, verdict.idle)
                due = self.policies.visit(verdict.pod, seen, now)
                if due is not None:
                    wake.append(due)
        if self.nodes is not None:
            due = self.nodes.visit(
                spec.node_name, status.orphaned, certain=not stale and not decision.blind, now=now
            )
            if due is not None:
                wake.append(due)
        if self.policies is not None:
            self.policies.ledger.flush()
        if previous is None or previous != status:  # the bodies are built only to be compared
            wanted = status.to_patch()
            known = None if previous is None else previous.to_patch()
            if known != wanted:
                response = write_status(
                    self._custom,
                    self.counts,
                    name=name,
                    meta=body["metadata"],
                    known=known,
                    wanted=wanted,
                )
                written = echo_version(response, body["metadata"].get("generation"))
        echo = None  # a failed pod write is retried on the echo instead
        if written is not None and self.counts.pod_writes_missed == missed:
            echo = written
        term.book.put(  # once, whole: other threads read it
            name,
            ReportMemory(
                stale=stale,
                echo=echo,
                listing=decision.listing,
                unattributed=unattributed,
                judged_whole=True,
                orphaned=status.orphaned,
                unmarked=tuple(unmarked),
                blind=tuple((d.uuid, d.blind) for d in status.devices if d.blind),
            ),
        )
        if wake:  # a report that does not change sends no event: judged again then
            self.queue.add_after(name, (min(wake) - now).total_seconds(), DEADLINE)
        self.liveness.watch(name, now)
        return stale

    def needs_reconcile(self, name: str, reasons: frozenset[Hashable], now: datetime) -> bool:
        """Whether what the report was queued for matters to it (see triggers): any reason but
        these does; a freshness reason only when the report's freshness by `now` differs from
        the verdict in force (see liveness), a pod's edited marks unless they echo our own
        write, a deleted pod only when the status lists it."""
        for reason in reasons or {None}:
            if isinstance(reason, Edited):
                if not self.marker.wrote(reason.uid, reason.version):
                    return True
            elif isinstance(reason, Gone):
                if self.book.lists(name, reason.uid):
                    return True
            elif reason in FRESHNESS:
                if self.liveness.flipped(name, now):
                    return True
            else:
                return True
        return False

    def _unmark(self, ref: PodSnapshot | None) -> None:
        """A pod outside the scope carries no marks of ours: those an earlier start wrote come
        off, once (unless this install may not write pods: then they stay, said by the
        housekeeping pass)."""
        if ref is not None and ref.marked and self.marker.clear(ref):
            self.counts.add("marks_removed")

    def forget_pods(self, uids: set[str]) -> None:
        """These pods were deleted: nothing of them is kept (the worker of their node's report
        calls it, so no reconcile of that report runs meanwhile)."""
        term = self.terms.current
        for uid in uids:
            term.absent.pop(uid, None)
            term.seen_on.pop(uid, None)
            self.marker.forget(uid)

    def forget_node(self, node: str, lookup: PodLookup, now: datetime) -> None:
        """The node's report was deleted: nothing is known about its GPUs any more, so its
        pods lose every mark gpuusage put on them (annotations and condition), at once."""
        self.book.drop(node)
        self.liveness.forget(node)
        for ref in lookup.on_node_with_our_marks(node):
            self.marker.clear(ref)
        if self.nodes is not None:
            self.nodes.forget(node, now)


def remember(term: Term, verdict: Verdict) -> None:
    """What the judge said of a pod that the next report's judging reads (see judge_report):
    since when its processes are absent, where it was last seen in use."""
    uid = verdict.pod.uid
    if verdict.absent_since is None:
        term.absent.pop(uid, None)
    else:
        term.absent[uid] = verdict.absent_since
    if verdict.settles_until is not None or verdict.state == "Unknown":
        return  # nothing known anew of where it is
    devices = verdict.use.devices if verdict.state == "InUse" and verdict.use else ()
    term.seen_on[uid] = tuple(devices)
