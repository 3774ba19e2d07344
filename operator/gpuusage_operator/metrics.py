"""The operator's own Prometheus metrics, on a registry of its own (no process-wide globals).

Write counts, unattributed processes and clock skews are read from the Reconciler at scrape
time rather than counted twice; what only the kopf wiring sees (reconcile duration, errors that
escape a reconcile, whether this replica is active) is recorded here.
"""

from __future__ import annotations

from collections import Counter as TallyCounter
from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuusage.api.reasons import UnattributedReason
from gpuusage_operator.controller.reconcile import Reconciler
from gpuusage_operator.informers.apihealth import ApiHealth

UNATTRIBUTED_REASONS: tuple[str, ...] = get_args(UnattributedReason)


class _ReconcilerCollector(Collector):
    def __init__(
        self, reconciler: Reconciler, index_size: Callable[[], int], health: ApiHealth
    ) -> None:
        self._reconciler = reconciler
        self._index_size = index_size
        self._health = health

    def collect(self) -> Iterator[Metric]:
        c = self._reconciler.counts
        writes = CounterMetricFamily(
            "gpuusage_operator_writes", "Writes made by this replica, by target.", labels=["target"]
        )
        writes.add_metric(["report_status"], c.status_writes)
        writes.add_metric(["pod"], c.pod_writes)
        writes.add_metric(["event"], c.events)
        writes.add_metric(["openreport"], c.openreport_writes)
        yield writes
        errors = CounterMetricFamily(
            "gpuusage_operator_api_errors", "API errors on pod writes, by kind.", labels=["kind"]
        )
        for kind, n in sorted(c.api_errors.items()):
            errors.add_metric([kind], n)
        yield errors
        policies = self._reconciler.policies
        if policies is not None:
            decided = CounterMetricFamily(
                "gpuusage_operator_policy_decisions",
                "GpuUsagePolicy decisions taken by this replica, by policy, action and outcome "
                "(Pending, DryRun, Done, Refused, NotPermitted, NotApplicable, Cancelled).",
                labels=["policy", "action", "outcome"],
            )
            for (policy, action, outcome), n in sorted(policies.decided.items()):
                decided.add_metric([policy, action, outcome], n)
            yield decided
        yield CounterMetricFamily(
            "gpuusage_operator_openreport_errors",
            "OpenReports writes that did not land (tried again at the next housekeeping pass).",
            value=c.openreport_errors,
        )
        yield CounterMetricFamily(
            "gpuusage_operator_status_write_conflicts",
            "Status writes of only what changed that the apiserver refused because the report "
            "had changed since it was read; the whole status was written instead.",
            value=c.status_conflicts,
        )
        yield CounterMetricFamily(
            "gpuusage_operator_events_dropped",
            "Events not written because their object's rate (a burst of 25, then one every 5 "
            "minutes) or the cluster-wide one (a burst of 200, then 20 a second) was spent.",
            value=c.events_dropped,
        )
        yield CounterMetricFamily(
            "gpuusage_operator_pod_writes_deferred",
            "Pods whose writes waited for a later reconcile of their report because the "
            "cluster-wide budget of pod writes (a burst of 500, then 50 a second) was spent.",
            value=c.writes_deferred,
        )
        yield CounterMetricFamily(
            "gpuusage_operator_echoes_skipped",
            "Report events skipped because they only echo this replica's own status write.",
            value=c.echoes_skipped,
        )
        yield CounterMetricFamily(
            "gpuusage_operator_pod_writes_refused_for_uid",
            "Pod writes the apiserver refused because the pod of that name had been replaced by "
            "another (its UID differed from the one the write was decided for).",
            value=c.uid_refusals,
        )
        yield GaugeMetricFamily(
            "gpuusage_operator_pod_index_size",
            "Pods in the operator's index.",
            value=self._index_size(),
        )
        outside = GaugeMetricFamily(
            "gpuusage_operator_unattributed_processes",
            "Processes in the reports this replica reconciled that belong to no pod, by reason "
            "(PodOnOtherNode: a report named a pod of another node, which is never touched).",
            labels=["reason"],
        )
        by_reason: TallyCounter[str] = TallyCounter()
        for counted in self._reconciler.book.unattributed():
            by_reason.update(counted)
        for reason in UNATTRIBUTED_REASONS:
            outside.add_metric([reason], by_reason[reason])
        yield outside
        skew = GaugeMetricFamily(
            "gpuusage_operator_report_clock_skew_seconds",
            "For reports whose agent's clock is off by more than a minute: spec.observedAt minus "
            "the time this replica saw the report change (positive: the node's clock is ahead).",
            labels=["node"],
        )
        for node, seconds in sorted(self._reconciler.liveness.clock_skews().items()):
            skew.add_metric([node], seconds)
        yield skew
        yield GaugeMetricFamily(
            "gpuusage_operator_api_available",
            "0 while the Kubernetes API (or its etcd) does not answer this replica.",
            value=1.0 if self._health.available else 0.0,
        )
        yield CounterMetricFamily(
            "gpuusage_operator_api_failed_calls",
            "Calls to the Kubernetes API that found it unavailable (pod watch, probe).",
            value=self._health.failures,
        )


class OperatorMetrics:
    """Reconcile duration and failures, activity, and the reconciler's write counts."""

    def __init__(
        self, reconciler: Reconciler, index_size: Callable[[], int], health: ApiHealth
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconcile_seconds = Histogram(
            "gpuusage_operator_reconcile_duration_seconds",
            "Time to reconcile one GpuNodeUsage (status, pods, Events).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.reconcile_failures = Counter(
            "gpuusage_operator_reconcile_failures_total",
            "Reconciles that failed as a whole (e.g. the status write), by kind.",
            ["kind"],
            registry=r,
        )
        self.reports_held = Counter(
            "gpuusage_operator_report_events_held_total",
            "Report events that came within a second of the report's last reconcile: held, "
            "and the report's latest version reconciled once the second had passed.",
            registry=r,
        )
        self.active = Gauge(
            "gpuusage_operator_active",
            "1 while this replica leads (holds the operator's Lease within its renew deadline).",
            registry=r,
        )
        self.leadership_acquired = Counter(
            "gpuusage_operator_leadership_acquired_total",
            "Times this replica started leading: took the operator's Lease, or took it back "
            "after its renew deadline had passed.",
            registry=r,
        )
        self.reports = Gauge(
            "gpuusage_operator_reports", "GpuNodeUsage objects this replica knows.", registry=r
        )
        r.register(_ReconcilerCollector(reconciler, index_size, health))

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)
