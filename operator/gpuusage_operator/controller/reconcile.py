"""Apply what the pure core wants: GpuNodeUsage status, pod annotations, pod condition, Events.

One idempotent reconcile per report, run in kopf's executor (the `kubernetes` client is
synchronous): decide judges the report, writers.pods writes the pods, writers.status the status;
this room keeps what the operator knows between reports (when it saw each report change, what
its status lists, when a report is next due) and the order of the writes. Writes happen only
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
import socket
import time
from collections import Counter as TallyCounter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from kubernetes import client
from pydantic import ValidationError

from gpuusage.api.models import GpuNodeUsageSpec, GpuNodeUsageStatus
from gpuusage_operator.controller.debounce import WriteBudget
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.index.dra import NO_DRA, DraLookup
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.freshness import (
    DEFAULT_STALE_AFTER,
    MAX_CLOCK_SKEW,
    Renewal,
    Sighting,
    alive_at,
    is_stale,
    sight,
)
from gpuusage_operator.judge.idle import DEFAULT_IDLE_AFTER
from gpuusage_operator.judge.podstate import Verdict
from gpuusage_operator.judge.report import Judging, judge_report
from gpuusage_operator.judge.requests import DEFAULT_RULES, AllocationRules
from gpuusage_operator.judge.resolution import DEFAULT_DRIVER_NAMESPACES
from gpuusage_operator.judge.restarts import RESTART_GRACE, RestartCause, settle_until
from gpuusage_operator.policies.noderun import NodeRunner
from gpuusage_operator.policies.run import PolicyRunner
from gpuusage_operator.writers.events import EventRecorder
from gpuusage_operator.writers.pods import PodMarker
from gpuusage_operator.writers.status import echo_version, write_status

log = logging.getLogger(__name__)
COMPONENT = "gpuusage.io/operator"
DUE, DEADLINE, STALENESS, EDITED = "due", "deadline", "staleness", "edited"
"""Why a report was queued (see workqueue): a pod event or a policy change, a deadline of
its judgement, the time it would turn stale, a pod's marks edited."""
STALE_MARGIN = 0.05
"""Seconds past the moment a report would turn stale (is_stale: strictly older)."""


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
    uid_refusals: int = 0
    """Pod writes the apiserver refused because the pod of that name had another UID."""
    writes_deferred: int = 0
    """Pods whose writes waited for a later reconcile: the cluster-wide budget was spent."""
    api_errors: TallyCounter[str] = field(default_factory=TallyCounter)
    """Pod write failures by kind (NotFound is no failure: the pod went away meanwhile)."""

    @property
    def pod_errors(self) -> int:
        return sum(self.api_errors.values())

    @property
    def pod_writes_missed(self) -> int:
        """Pod writes that did not land: failures and refusals for another UID."""
        return self.pod_errors + self.uid_refusals


@dataclass(frozen=True)
class ReportMemory:
    """What this replica remembers of one report between its reconciles: created by its first
    reconcile, replaced whole by each (other threads read it without a lock), dropped only when
    the report is deleted (Reconciler.forget_node)."""

    sighting: Sighting
    """When this replica saw the report's current generation appear (see freshness), and
    whether its status says stale."""
    echo: str | None = None
    """The resourceVersion our last status write gave it, when that reconcile wrote everything
    it wanted: the watch event of that version only echoes our own write."""
    listing: frozenset[str] = frozenset()
    """The UIDs of the pods its status lists."""
    unattributed: TallyCounter[str] = field(default_factory=TallyCounter)
    """Its processes that belong to no pod, by reason (for the metrics)."""


@dataclass
class Reconciler:
    api: client.ApiClient
    stale_after: timedelta = DEFAULT_STALE_AFTER
    idle_after: timedelta | None = DEFAULT_IDLE_AFTER
    """How long requested GPUs may go unused before the pod is flagged; None: never."""
    restart_grace: timedelta = RESTART_GRACE
    """How long after a container's exit its pod's missing use is a restart (see restarts)."""
    instance: str = field(default_factory=socket.gethostname)
    """Names this replica in Events (reportingInstance)."""
    counts: Counts = field(default_factory=Counts)
    refresh: Callable[[str, str, str], None] = lambda namespace, name, stale_uid: None
    """Reads one pod into the index again (PodWatch.refresh): called when a write for a pod was
    refused because the pod of that name is now another one."""
    _reports: dict[str, ReportMemory] = field(default_factory=dict)
    """Report name → what this replica remembers of it (see ReportMemory)."""
    _absent: dict[str, datetime] = field(default_factory=dict)
    """Pod UID → when a report first showed none of the processes of a pod marked in use
    (see restarts: its marks settle before use is called ended)."""
    queue: WorkQueue = field(default_factory=WorkQueue)
    """Every reason to reconcile a report, by its name (see workqueue): the operator's workers
    take them one report at a time, so two reconciles of one report never run at once (both
    would decide from the same pod state and both write: two start Events)."""

    rules: AllocationRules = DEFAULT_RULES
    """What counts as handing a pod a GPU (see allocation)."""
    driver_namespaces: frozenset[str] = frozenset(DEFAULT_DRIVER_NAMESPACES)
    """Where NVIDIA's daemons (the MPS server) run as pods (see resolution)."""
    policies: PolicyRunner | None = None
    """Carries out the GpuUsagePolicies about the pods each reconcile judges (None: none)."""
    nodes: NodeRunner | None = None
    """Carries out the policies' node rules about each reconciled node (None: none)."""
    renewals: Callable[[str], Renewal | None] = field(default=lambda node: None)
    """A node agent's Lease as the operator saw it renewed (see informers.leases); by default none
    is known, and freshness comes from the reports alone."""
    write_budget: WriteBudget = field(default_factory=WriteBudget)
    """Pod writes across all reports (see debounce): over it, a pod's writes wait for the
    next reconcile of its report, which is made due."""
    monotonic: Callable[[], float] = time.monotonic
    reports_api: Any = None
    """Where report statuses are written (a kubernetes CustomObjectsApi); by default one on
    `api`. Tests pass a stand-in that answers as the apiserver does."""

    def __post_init__(self) -> None:
        self._core = client.CoreV1Api(self.api)
        self._custom = self.reports_api or client.CustomObjectsApi(self.api)
        self.events = EventRecorder(
            client.EventsV1Api(self.api), self.counts, self.instance, COMPONENT
        )
        self.marker = PodMarker(
            self._core,
            self.counts,
            self.events,
            self.write_budget,
            self.monotonic,
            due=self.mark_due,
            # late-bound: main sets `refresh` once the pod watch exists
            refresh=lambda namespace, name, uid: self.refresh(namespace, name, uid),  # noqa: PLW0108
        )
        self._judging = Judging(
            self.rules,
            self.driver_namespaces,
            self.stale_after,
            self.idle_after,
            self.restart_grace,
            self.marker.last_devices,
        )

    # -- reports ---------------------------------------------------------------------------
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

    def reconcile(
        self, body: dict[str, Any], lookup: PodLookup, now: datetime, dra: DraLookup = NO_DRA
    ) -> bool:
        """Bring status and pods in line with one report; True when the report is stale.
        `dra` tells what the pods' claims got (by default nothing is known of claims). One
        at a time per report: the queue's workers call it (tests, alone)."""
        name = body["metadata"]["name"]
        self.counts.reconciles += 1
        memory = self._reports.get(name)
        if memory is not None and memory.echo is not None:
            self._reports[name] = memory = replace(memory, echo=None)
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
        sighting = sight(
            None if memory is None else memory.sighting,
            generation,
            spec.observed_at,
            previous,
            now,
            stale_after=self.stale_after,
        )
        memory = ReportMemory(sighting) if memory is None else replace(memory, sighting=sighting)
        self._reports[name] = memory
        renewal = self.renewals(name)
        decision = judge_report(
            spec,
            previous,
            generation=generation,
            sighting=sighting,
            renewal=renewal,
            lookup=lookup,
            dra=dra,
            now=now,
            judging=self._judging,
        )
        unattributed: TallyCounter[str] = TallyCounter(
            r.reason for r in decision.resolutions if r.reason
        )
        self._reports[name] = memory = replace(memory, unattributed=unattributed)
        status, stale = decision.status, decision.status.stale
        wake = list(decision.wake)
        # Pods first: their annotations and condition are what people read, and each write
        # waits on the apiserver; the status follows.
        for verdict in decision.verdicts:
            hold = self._settling(verdict, now)
            if hold is not None:
                wake.append(hold)
                continue
            if isinstance(verdict.unknown, RestartCause):
                wake.append(verdict.unknown.until)
            shown = self.marker.mark(verdict, spec.node_name, now)
            if self.policies is not None and shown is not None:
                since = verdict.judgement.held_idle_since if verdict.judgement else None
                due = self.policies.visit(verdict.pod, shown, since, now)
                if due is not None:
                    wake.append(due)
        if self.nodes is not None:
            due = self.nodes.visit(
                spec.node_name, status.orphaned, certain=not stale and not decision.blind, now=now
            )
            if due is not None:
                wake.append(due)
        if self.policies is not None:
            self.policies.flush()
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
        self._reports[name] = replace(
            memory,
            sighting=replace(sighting, stale=stale),  # what the status now says
            echo=echo,
            listing=decision.listing,
        )
        if wake:  # a report that does not change sends no event: judged again then
            self.queue.add_after(name, (min(wake) - now).total_seconds(), DEADLINE)
        self.watch_staleness(name, now)
        return stale

    def staleness_flipped(self, name: str, now: datetime) -> bool:
        """Whether the report's freshness by `now` differs from what its status says."""
        memory = self._reports.get(name)
        if memory is None:
            return False
        seen = memory.sighting
        return is_stale(alive_at(seen, self.renewals(name)), now, self.stale_after) != seen.stale

    def watch_staleness(self, name: str, now: datetime) -> None:
        """A fresh report turns stale with no event (a dead agent writes nothing): its name is
        queued for when it would, with the reason STALENESS (the worker checks that it has,
        a Lease renewed meanwhile may have kept it fresh, and reconciles only then)."""
        memory = self._reports.get(name)
        if memory is None or memory.sighting.stale:
            return
        seen = memory.sighting
        turns = alive_at(seen, self.renewals(name)) + self.stale_after
        delay = (turns - now).total_seconds() + STALE_MARGIN
        self.queue.add_after(name, delay, STALENESS)

    def lease_renewed(self, name: str) -> None:
        """A node's Lease was renewed: a report whose status says stale may be fresh again
        (its agent back without a report change). Called from the Lease watch's thread."""
        memory = self._reports.get(name)
        if memory is not None and memory.sighting.stale:
            self.mark_due({name})

    def known_reports(self) -> set[str]:
        """Every report reconciled since start (what a policy's node rules may concern: a
        policy that comes, changes or goes reaches nodes whose pods carry no mark too)."""
        return set(self._reports)

    def clock_skews(self) -> dict[str, float]:
        """Reports whose agent's clock is off by more than MAX_CLOCK_SKEW: seconds, by name."""
        skews = {name: memory.sighting.skew for name, memory in list(self._reports.items())}
        return {
            name: skew.total_seconds()
            for name, skew in skews.items()
            if skew is not None and abs(skew) > MAX_CLOCK_SKEW
        }

    def unattributed(self) -> list[TallyCounter[str]]:
        """Each remembered report's processes that belong to no pod, by reason."""
        return [memory.unattributed for memory in list(self._reports.values())]

    def pods_deleted(self, uids: set[str]) -> None:
        """Pods went away: the reports that list them are due, so that no status keeps naming
        a deleted pod until its report's next event. Called from the pod watch's thread."""
        listing = {name: memory.listing for name, memory in list(self._reports.items())}
        self.mark_due({name for name, listed in listing.items() if listed & uids})
        for uid in uids:  # one at a time: the reconciles' threads use them too
            self._absent.pop(uid, None)
            self.marker.forget(uid)

    def remembered_pods(self) -> set[str]:
        """The pods (by UID) of which the operator keeps something: what it wrote on them,
        since when their processes were absent. Bounded by the pods that exist."""
        return self.marker.remembered() | set(self._absent)

    def marks_changed(self, pod: PodSnapshot) -> None:
        """A pod's gpuusage.io/ annotations or GPUInUse condition changed. Unless that is the
        echo of our own write, someone edited them: its node's report is due, and its reconcile
        compares what the pod carries with what it should carry (level-triggered, as a
        controller is), without waiting for a report event. Called from the pod watch's
        thread."""
        if pod.node:  # judged when taken: our own write's echo may come before we note it
            self.queue.add(pod.node, (EDITED, pod.uid, pod.resource_version))

    def only_echoes(self, reasons: Iterable[Hashable]) -> bool:
        """Whether a report was queued only for pod edits that echo our own writes (judged
        now, when a worker takes it: the echo may have come before the write's answer)."""
        listed = list(reasons)
        edits = [r for r in listed if isinstance(r, tuple) and r[:1] == (EDITED,)]
        return (
            bool(edits)
            and len(edits) == len(listed)
            and all(self.marker.wrote(uid, version) for _, uid, version in edits)
        )

    def mark_due(self, names: set[str]) -> None:
        """These reports are to be reconciled without an event of their own (any thread)."""
        for name in names:
            self.queue.add(name, DUE)

    def forget_node(self, node: str, lookup: PodLookup, now: datetime) -> None:
        """The node's report was deleted: nothing is known about its GPUs any more, so its
        pods lose every mark gpuusage put on them (annotations and condition), at once."""
        self._reports.pop(node, None)
        for ref in lookup.on_node_with_our_marks(node):
            self.marker.clear(ref)
        if self.nodes is not None:
            self.nodes.forget(node, now)

    # -- pods ------------------------------------------------------------------------------
    def _settling(self, verdict: Verdict, now: datetime) -> datetime | None:
        """Until when the pod's marks stay as they are (see restarts.settle_until); None: act
        on the verdict now."""
        uid = verdict.pod.uid
        if verdict.state != "Stopped" and not isinstance(verdict.unknown, RestartCause):
            self._absent.pop(uid, None)
            return None
        until = settle_until(verdict.pod, self._absent.setdefault(uid, now), now)
        if until is None:
            self._absent.pop(uid, None)
        return until
