"""The operator's own Prometheus metrics, on a registry of its own (no process-wide globals).

Write counts are read from the Reconciler's Counts at scrape time rather than counted twice;
what only the kopf wiring sees (reconcile duration, errors that escape a reconcile, whether
this replica is active) is recorded here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuusage.operator.reconcile import Counts


class _CountsCollector(Collector):
    def __init__(self, counts: Counts, index_size: Callable[[], int]) -> None:
        self._counts = counts
        self._index_size = index_size

    def collect(self) -> Iterator[Metric]:
        c = self._counts
        writes = CounterMetricFamily(
            "gpuusage_operator_writes", "Writes made by this replica, by target.", labels=["target"]
        )
        writes.add_metric(["report_status"], c.status_writes)
        writes.add_metric(["pod"], c.pod_writes)
        writes.add_metric(["event"], c.events)
        yield writes
        errors = CounterMetricFamily(
            "gpuusage_operator_api_errors", "API errors on pod writes, by kind.", labels=["kind"]
        )
        for kind, n in sorted(c.api_errors.items()):
            errors.add_metric([kind], n)
        yield errors
        yield GaugeMetricFamily(
            "gpuusage_operator_pod_index_size", "Pods in the operator's index.",
            value=self._index_size(),
        )  # fmt: skip


class OperatorMetrics:
    """Reconcile duration and failures, activity, and the reconciler's write counts."""

    def __init__(self, counts: Counts, index_size: Callable[[], int]) -> None:
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
            ["kind"], registry=r,
        )  # fmt: skip
        self.echoes_skipped = Counter(
            "gpuusage_operator_echoes_skipped_total",
            "Report events skipped because they only echo this replica's own status write.",
            registry=r,
        )
        self.active = Gauge(
            "gpuusage_operator_active", "1 when this replica is the active one.", registry=r
        )
        self.reports = Gauge(
            "gpuusage_operator_reports", "GpuNodeUsage objects this replica knows.", registry=r
        )
        r.register(_CountsCollector(counts, index_size))

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)
