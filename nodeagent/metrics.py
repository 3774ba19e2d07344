"""The agent's own Prometheus metrics, on a registry of its own (no process-wide globals)."""

from __future__ import annotations

from collections import Counter as TallyCounter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class AgentMetrics:
    """Cycle duration, GPU library errors by kind, API writes and failures, what was seen."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.cycle_seconds = Histogram(
            "gpuusage_agent_cycle_duration_seconds",
            "Time to observe the GPUs and attribute their processes (one cycle).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.nvml_errors = Counter(
            "gpuusage_agent_nvml_errors_total", "GPU library errors, by kind.", ["kind"], registry=r
        )
        self.api_writes = Counter(
            "gpuusage_agent_api_writes_total", "Writes of the node's GpuNodeUsage.", ["verb"],
            registry=r,
        )  # fmt: skip
        self.api_bytes = Counter(
            "gpuusage_agent_api_write_bytes_total", "Bytes of request bodies written.", registry=r
        )
        self.api_failures = Counter(
            "gpuusage_agent_api_failures_total", "Failed writes after retries, by kind.",
            ["kind"], registry=r,
        )  # fmt: skip
        self.skipped = Counter(
            "gpuusage_agent_writes_skipped_total",
            "Cycles whose observation did not differ enough from the published one.",
            registry=r,
        )
        self.gpus = Gauge("gpuusage_agent_gpus", "GPUs in the latest observation.", registry=r)
        self.processes = Gauge(
            "gpuusage_agent_processes", "GPU processes in the latest observation.", registry=r
        )
        self.unresolved = Gauge(
            "gpuusage_agent_unresolved_processes",
            "GPU processes whose pid could not be attributed in the latest observation.",
            registry=r,
        )
        self.nvml_available = Gauge(
            "gpuusage_agent_nvml_available", "1 when the GPU library works on this node.",
            registry=r,
        )  # fmt: skip
        self.last_publish = Gauge(
            "gpuusage_agent_last_publish_timestamp_seconds",
            "Unix time of the latest successful write.",
            registry=r,
        )

    def count_errors(self, errors: TallyCounter[str]) -> None:
        for kind, n in errors.items():
            self.nvml_errors.labels(kind=kind).inc(n)

    def count_write(self, verb: str, size: int) -> None:
        self.api_writes.labels(verb=verb).inc()
        self.api_bytes.inc(size)

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)
