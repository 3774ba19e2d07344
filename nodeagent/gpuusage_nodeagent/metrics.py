"""The agent's own Prometheus metrics, on a registry of its own (no process-wide globals), and
its health endpoint.

`/healthz` answers 200 while cycles keep completing and 503 once none has completed for three
intervals (plus a grace period): a liveness probe then restarts an agent whose loop is stuck,
for example in a driver call that never returns, which serving `/metrics` alone would hide.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as TallyCounter
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app


class AgentMetrics:
    """Cycle duration, GPU library errors by kind, API writes and failures, what was seen."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.last_cycle: float | None = None
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
            "gpuusage_agent_api_writes_total",
            "Writes to the API: the report (create, patch) and the Lease (lease-create, lease).",
            ["verb"],
            registry=r,
        )
        self.api_bytes = Counter(
            "gpuusage_agent_api_write_bytes_total", "Bytes of request bodies written.", registry=r
        )
        self.api_failures = Counter(
            "gpuusage_agent_api_failures_total",
            "Failed writes after retries, by kind.",
            ["kind"],
            registry=r,
        )
        self.skipped = Counter(
            "gpuusage_agent_writes_skipped_total",
            "Cycles whose observation did not differ enough from the published one.",
            registry=r,
        )
        self.cycle_failures = Counter(
            "gpuusage_agent_cycle_failures_total",
            "Cycles that failed with an unexpected error (logged; the loop goes on), by kind.",
            ["kind"],
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
            "gpuusage_agent_nvml_available",
            "1 when the GPU library works on this node.",
            registry=r,
        )
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

    def serve(self, address: str, port: int, interval: float = 10.0) -> None:
        """/metrics and /healthz on one port, from a daemon thread."""
        metrics = self
        exposition = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            if environ.get("PATH_INFO") == "/healthz":
                ok, text = healthy(metrics.last_cycle, time.monotonic(), interval)
                start_response(
                    "200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")]
                )
                return [text.encode()]
            return exposition(environ, start_response)

        server = make_server(address, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="agent-http", daemon=True).start()

    def cycle_done(self) -> None:
        """Record that a cycle completed (for /healthz)."""
        self.last_cycle = time.monotonic()


GRACE_SECONDS = 30.0


def healthy(last_cycle: float | None, now: float, interval: float) -> tuple[bool, str]:
    """Whether the agent's loop is alive: a cycle completed within 3 intervals + grace.

    Before the first cycle (start-up, a slow first NVML initialisation) it counts as alive.
    """
    if last_cycle is None:
        return True, "starting"
    age = now - last_cycle
    if age <= 3 * interval + GRACE_SECONDS:
        return True, f"last cycle {age:.1f}s ago"
    return False, f"no cycle completed for {age:.1f}s (interval {interval:g}s)"


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds are not worth a log line each."""
