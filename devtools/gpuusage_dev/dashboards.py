"""The Grafana dashboards, from one compact description of their panels.

Each dashboard is a list of panels (title, kind, PromQL queries) over the gpuusage_* series
and the showback recording rules; this module turns them into Grafana's dashboard JSON
(`make monitoring` writes manifests/monitoring/dashboards/, a test fails when they differ, and
another evaluates every query with promtool on series scraped from kube-state-metrics).

Template variables: `datasource` (any Prometheus), and as each view needs them `node`,
`namespace` and `pod`, filled from the series themselves.

    python -m gpuusage_dev.dashboards manifests/monitoring/dashboards
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STALE = 'gpuusage_node_condition{condition="Stale", status="True"} == 1'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries, stat or table
    queries: tuple[Query, ...]
    unit: str = "none"
    description: str = ""
    width: int = 12
    stacked: bool = False
    """A timeseries whose series add up (shares of one GPU's time): drawn stacked."""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _q(expr: str, legend: str = "") -> Query:
    return Query(" ".join(expr.split()), legend)


OVERVIEW = Dashboard(
    "gpuusage-overview",
    "gpuusage / Cluster",
    "GPU memory and devices in use across the cluster, and what needs a look.",
    (),
    (
        Panel(
            "GPU memory used / total",
            "timeseries",
            (
                _q("sum(gpuusage_node_memory_used_mib)", "used"),
                _q("sum(gpuusage_node_memory_total_mib)", "total"),
            ),
            unit="mbytes",
            description="Memory of all GPU processes against the memory of all GPUs (MiB).",
        ),
        Panel(
            "Pods using GPUs",
            "stat",
            (_q("sum(gpuusage_node_pods)"),),
            width=4,
        ),
        Panel(
            "Stale nodes",
            "stat",
            (_q(f"count({STALE}) or vector(0)"),),
            description="Nodes whose agent has not reported in time: their numbers are old.",
            width=4,
        ),
        Panel(
            "GPU memory outside pods",
            "stat",
            (_q("sum(gpuusage_gpu_unattributed_memory_mib)"),),
            unit="mbytes",
            description="Held by processes that belong to no known pod (host, deleted pods).",
            width=4,
        ),
        Panel(
            "Orphaned GPU memory",
            "stat",
            (_q("sum(gpuusage_node_orphaned_memory_mib) or vector(0)"),),
            unit="mbytes",
            description="Held by processes of no live pod: pods gone, containers of no pod, "
            "host processes (what a policy's OrphanedGPUMemory rule acts on).",
            width=4,
        ),
        Panel(
            "Policy actions in the last hour",
            "timeseries",
            (
                _q(
                    "sum by (policy) (increase(gpuusage_policy_actions_taken[1h]))",
                    "{{policy}}",
                ),
            ),
            description="Enforced actions each GpuUsagePolicy carried out within the hour "
            "(kubectl get gpuusagepolicy NAME -o yaml lists the decisions).",
        ),
        Panel(
            "Pods without an allocation, outside it, idle",
            "timeseries",
            (
                _q("sum(gpuusage_node_unrequested_pods)", "using a GPU without an allocation"),
                _q("sum(gpuusage_node_unallocated_pods)", "using a device outside it"),
                _q("sum(gpuusage_node_idle_pods)", "requested GPUs idle"),
                _q("sum(gpuusage_node_held_idle_pods)", "holding memory, computing nothing"),
            ),
        ),
        Panel(
            "Nodes",
            "table",
            (
                _q("sum by (node) (gpuusage_node_memory_used_mib)", "used MiB"),
                _q("sum by (node) (gpuusage_node_gpus)", "GPUs"),
                _q("sum by (node) (gpuusage_node_pods)", "pods"),
            ),
            width=24,
        ),
    ),
)

NODE = Dashboard(
    "gpuusage-node",
    "gpuusage / Node",
    "One node's GPUs and MIG devices: memory, processes, and memory no pod explains.",
    ("node",),
    (
        Panel(
            "Memory used per device",
            "timeseries",
            (_q('gpuusage_gpu_memory_used_mib{node="$node"}', "{{gpu}}"),),
            unit="mbytes",
        ),
        Panel(
            "Memory used / total per device",
            "timeseries",
            (
                _q(
                    'gpuusage_gpu_memory_used_mib{node="$node"}'
                    ' / gpuusage_gpu_memory_total_mib{node="$node"}',
                    "{{gpu}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Pods on this node's GPUs",
            "timeseries",
            (
                _q(
                    'sum by (namespace, pod) (gpuusage_pod_gpu_memory_used_mib{node="$node"})',
                    "{{namespace}}/{{pod}}",
                ),
            ),
            unit="mbytes",
        ),
        Panel(
            "Who gets each GPU's compute: pods' shares of its time",
            "timeseries",
            (
                _q(
                    'gpuusage_pod_gpu_compute_share{node="$node"}',
                    "{{gpu}} {{namespace}}/{{pod}}",
                ),
            ),
            unit="percentunit",
            description="Each pod's share of a GPU's time over the agent's --share-window, "
            "measured from the driver's sampler, by GPU: the pods of one GPU add up to its busy "
            "time (at most 100 %), so the node's stack reaches at most 100 % a GPU. MIG devices "
            "and MPS clients tell none.",
            stacked=True,
            width=24,
        ),
        Panel(
            "Processes and memory outside pods, per device",
            "timeseries",
            (
                _q('gpuusage_gpu_processes{node="$node"}', "processes {{gpu}}"),
                _q(
                    'gpuusage_gpu_unattributed_memory_mib{node="$node"}',
                    "MiB outside pods {{gpu}}",
                ),
            ),
        ),
    ),
)

NAMESPACE = Dashboard(
    "gpuusage-namespace",
    "gpuusage / Namespace (showback)",
    "What a namespace's pods used (GPU memory, whole GPUs, MIG slices) against what they were "
    "handed (GPUs, MIG slices, shares), and the hours over the selected time range (from the "
    "gpuusage-showback recording rules).",
    ("namespace",),
    (
        Panel(
            "GPU memory used",
            "timeseries",
            (
                _q(
                    'namespace:gpuusage_gpu_memory_used_mib:sum{namespace=~"$namespace"}',
                    "{{namespace}}",
                ),
            ),
            unit="mbytes",
        ),
        Panel(
            "GPUs and MIG slices in use",
            "timeseries",
            (
                _q(
                    'namespace:gpuusage_gpus_used:count{namespace=~"$namespace"}',
                    "GPUs {{namespace}}",
                ),
                _q(
                    'namespace:gpuusage_mig_devices_used:count{namespace=~"$namespace"}',
                    "MIG slices {{namespace}}",
                ),
            ),
        ),
        Panel(
            "GPU-hours used in the range",
            "stat",
            (
                _q(
                    "sum(sum_over_time("
                    'namespace:gpuusage_gpus_used:count{namespace=~"$namespace"}[$__range]'
                    ")) / 60"
                ),
            ),
            width=8,
        ),
        Panel(
            "MIG-slice-hours used in the range",
            "stat",
            (
                _q(
                    "sum(sum_over_time("
                    'namespace:gpuusage_mig_devices_used:count{namespace=~"$namespace"}[$__range]'
                    ")) / 60"
                ),
            ),
            width=8,
        ),
        Panel(
            "GPU memory GiB-hours used in the range",
            "stat",
            (
                _q(
                    "sum(sum_over_time("
                    "namespace:gpuusage_gpu_memory_used_mib:sum"
                    '{namespace=~"$namespace"}[$__range])) / 60 / 1024'
                ),
            ),
            width=8,
        ),
        Panel(
            "Handed to its pods: GPUs, MIG slices, shares",
            "timeseries",
            (
                _q(
                    'namespace:gpuusage_gpus_allocated:sum{namespace=~"$namespace"}',
                    "GPUs {{namespace}}",
                ),
                _q(
                    'namespace:gpuusage_mig_devices_allocated:sum{namespace=~"$namespace"}',
                    "MIG slices {{namespace}}",
                ),
                _q(
                    'namespace:gpuusage_gpu_shares_allocated:sum{namespace=~"$namespace"}',
                    "GPU shares {{namespace}}",
                ),
            ),
            description="What its running pods were handed (device plugin, DRA claims, a "
            "fractional scheduler's share), in use or not.",
        ),
        Panel(
            "GPU-hours handed in the range",
            "stat",
            (
                _q(
                    "sum(sum_over_time("
                    'namespace:gpuusage_gpus_allocated:sum{namespace=~"$namespace"}[$__range]'
                    ")) / 60"
                ),
            ),
            width=12,
        ),
        Panel(
            "GPU-hours computing in the range",
            "stat",
            (
                _q(
                    "sum(sum_over_time("
                    'namespace:gpuusage_gpus_computing:count{namespace=~"$namespace"}[$__range]'
                    ")) / 60"
                ),
            ),
            description="Whole GPUs on which a pod's process used an engine within the agent's "
            "--idle-window; devices that do not tell (MIG, MPS clients) never count.",
            width=12,
        ),
        Panel(
            "Compute hours in the range: shares of GPU time",
            "stat",
            (
                _q(
                    "sum(sum_over_time("
                    'namespace:gpuusage_gpu_compute_share:sum{namespace=~"$namespace"}'
                    "[$__range])) / 60"
                ),
            ),
            description="Each pod's measured share of its GPUs' time, summed: four pods "
            "time-sliced on one GPU add up to its busy hours, not four GPU-hours. GPUs that tell "
            "no share (MPS clients) are left out.",
            width=24,
        ),
        Panel(
            "Efficiency in the range: GPU-hours held and computing per GPU-hour handed",
            "stat",
            (
                _q(
                    "sum by (namespace) (sum_over_time("
                    'namespace:gpuusage_gpus_used:count{namespace=~"$namespace"}[$__range]))'
                    " / sum by (namespace) (sum_over_time("
                    'namespace:gpuusage_gpus_allocated:sum{namespace=~"$namespace"}[$__range]))'
                    " > 0",
                    "held {{namespace}}",
                ),
                _q(
                    "sum by (namespace) (sum_over_time("
                    'namespace:gpuusage_gpus_computing:count{namespace=~"$namespace"}[$__range]))'
                    " / sum by (namespace) (sum_over_time("
                    'namespace:gpuusage_gpus_allocated:sum{namespace=~"$namespace"}[$__range]))'
                    " > 0",
                    "computing {{namespace}}",
                ),
            ),
            unit="percentunit",
            description="Whole GPUs only: held is memory in use, computing an engine in use. "
            "Over 100 % means use beyond what was handed (GPUs used without a request).",
            width=24,
        ),
        Panel(
            "Pods: GPU-hours handed, held and computing in the range",
            "table",
            (
                _q(
                    "sum by (pod) (sum_over_time("
                    'namespace_pod:gpuusage_gpus_allocated:sum{namespace=~"$namespace"}'
                    "[$__range])) / 60",
                    "handed {{pod}}",
                ),
                _q(
                    "sum by (pod) (sum_over_time("
                    'namespace_pod:gpuusage_gpus_used:count{namespace=~"$namespace"}'
                    "[$__range])) / 60",
                    "held {{pod}}",
                ),
                _q(
                    "sum by (pod) (sum_over_time("
                    'namespace_pod:gpuusage_gpus_computing:count{namespace=~"$namespace"}'
                    "[$__range])) / 60",
                    "computing {{pod}}",
                ),
            ),
            width=24,
        ),
        Panel(
            "Pods by GPU memory",
            "table",
            (
                _q(
                    "sum by (pod, node) "
                    '(gpuusage_pod_gpu_memory_used_mib{namespace=~"$namespace"})',
                    "{{pod}}",
                ),
            ),
            unit="mbytes",
            width=24,
        ),
    ),
)

POD = Dashboard(
    "gpuusage-pod",
    "gpuusage / Pod",
    "One pod's GPU devices and memory, against what it requested.",
    ("namespace", "pod"),
    (
        Panel(
            "Memory per device",
            "timeseries",
            (
                _q(
                    'gpuusage_pod_gpu_memory_used_mib{namespace="$namespace", pod="$pod"}',
                    "{{gpu}} on {{node}}",
                ),
            ),
            unit="mbytes",
        ),
        Panel(
            "Devices in use / GPUs requested",
            "timeseries",
            (
                _q(
                    'count(gpuusage_pod_gpu_memory_used_mib{namespace="$namespace", pod="$pod"})',
                    "devices in use",
                ),
                _q(
                    'max(gpuusage_pod_requested_gpus{namespace="$namespace", pod="$pod"})',
                    "GPUs requested",
                ),
            ),
        ),
        Panel(
            "Findings",
            "timeseries",
            (
                _q(
                    'max(gpuusage_pod_gpu_unrequested{namespace="$namespace", pod="$pod"})',
                    "using a GPU without an allocation",
                ),
                _q(
                    'max(gpuusage_pod_gpu_unallocated{namespace="$namespace", pod="$pod"})',
                    "using a device outside its allocation",
                ),
                _q(
                    "max(gpuusage_pod_gpu_held_idle_since_timestamp_seconds"
                    '{namespace="$namespace", pod="$pod"}) > bool 0',
                    "holding memory, computing nothing",
                ),
            ),
            width=24,
        ),
    ),
)

DASHBOARDS = (OVERVIEW, NODE, NAMESPACE, POD)

VARIABLE_QUERIES = {
    "node": "label_values(gpuusage_node_gpus, node)",
    "namespace": "label_values(gpuusage_pod_gpu_memory_used_mib, namespace)",
    "pod": 'label_values(gpuusage_pod_gpu_memory_used_mib{namespace="$namespace"}, pod)',
}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": VARIABLE_QUERIES[name], "refId": f"{name}-values"},
        "definition": VARIABLE_QUERIES[name],
        "refresh": 2,
        "sort": 1,
        "includeAll": name == "namespace",
        "multi": name == "namespace",
    }


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    height = 4 if panel.kind == "stat" else 8
    body: dict[str, Any] = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                **({"custom": {"stacking": {"mode": "normal"}}} if panel.stacked else {}),
            },
            "overrides": [],
        },
        "options": {},
        "targets": [
            {
                "datasource": DATASOURCE,
                "expr": q.expr,
                "legendFormat": q.legend,
                "refId": chr(ord("A") + n),
                **({"format": "table", "instant": True} if panel.kind == "table" else {}),
            }
            for n, q in enumerate(panel.queries)
        ],
    }
    if panel.kind == "table":
        body["transformations"] = [{"id": "merge", "options": {}}]
    return body


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    """Grafana's JSON model of one dashboard (schema 39, Grafana 10 and later)."""
    panels, x, y, row_height = [], 0, 0, 0
    for pid, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        panels.append(_panel(panel, pid, x, y))
        row_height = max(row_height, 4 if panel.kind == "stat" else 8)
        x += panel.width
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
    }
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["gpuusage", "gpu"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "templating": {"list": [datasource, *(_variable(v) for v in dashboard.variables)]},
        "panels": panels,
    }


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard_json(dashboard), indent=2) + "\n"


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path("manifests/monitoring/dashboards")
    folder.mkdir(parents=True, exist_ok=True)
    for dashboard in DASHBOARDS:
        (folder / f"{dashboard.uid}.json").write_text(render(dashboard))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
