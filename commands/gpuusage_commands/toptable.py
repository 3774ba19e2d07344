"""The rows of `gpuusage top`: who holds the GPU memory, like `kubectl top pod`.

Rows come from the operator's work, the `status` of every GpuNodeUsage, so one LIST answers
for the whole cluster and the numbers are exactly what the annotations and alerts say. Pure
functions build and order the rows; the command only fetches and prints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from gpuusage.api.models import GpuNodeUsageStatus
from gpuusage.api.summary import format_mib
from gpuusage.api.times import format_time

SortKey = Literal["memory", "gpus", "processes", "name", "namespace", "node"]


@dataclass
class PodRow:
    """One pod's GPU use on one node."""

    namespace: str
    pod: str
    node: str
    devices: list[str] = field(default_factory=list)
    memory_mib: int = 0
    processes: int = 0
    requested_gpus: int = 0
    unrequested: bool = False
    allocated_by: list[str] = field(default_factory=list)
    allocated_devices: list[str] = field(default_factory=list)
    unallocated: bool = False
    """Uses a device outside its device-level allocation."""
    idle_since: str | None = None
    """Set for a pod that requested GPUs and has used none since then (status.idlePods)."""
    held_idle_since: str | None = None
    """Set for a pod whose processes hold memory and have computed nothing since then."""
    stale: bool = False


def pod_rows(reports: Iterable[Mapping[str, Any]]) -> tuple[list[PodRow], list[str]]:
    """Rows from GpuNodeUsage objects, and a warning for each one that cannot be read.

    A pod that uses several devices is one row; a pod that requested GPUs and leaves them idle
    is a row with no devices; a report without status yet (the operator has not seen it)
    contributes nothing.
    """
    rows: dict[tuple[str, str, str], PodRow] = {}
    warnings: list[str] = []
    for report in reports:
        node = str((report.get("metadata") or {}).get("name", "?"))
        raw = report.get("status")
        if not raw:
            continue
        try:
            status = GpuNodeUsageStatus.model_validate(raw)
        except ValidationError as exc:
            warnings.append(f"GpuNodeUsage {node}: status unreadable ({exc.error_count()} errors)")
            continue
        for pod in status.pods:
            row = rows.setdefault(
                (node, pod.namespace, pod.name), PodRow(pod.namespace, pod.name, node)
            )
            if pod.device_uuid not in row.devices:
                row.devices.append(pod.device_uuid)
            row.memory_mib += pod.used_memory_mib
            row.processes += sum(len(c.pids) for c in pod.containers)
            row.requested_gpus = pod.requested_gpus
            row.unrequested = pod.unrequested
            row.allocated_by = list(pod.allocated_by)
            row.allocated_devices = list(pod.allocated_devices)
            row.unallocated = row.unallocated or pod.unallocated
            if pod.held_idle_since is not None:
                row.held_idle_since = format_time(pod.held_idle_since)
            row.stale = status.stale
        for idle in status.idle_pods:
            rows.setdefault(
                (node, idle.namespace, idle.name),
                PodRow(
                    idle.namespace,
                    idle.name,
                    node,
                    requested_gpus=idle.requested_gpus,
                    idle_since=format_time(idle.idle_since),
                    stale=status.stale,
                ),
            )
    return list(rows.values()), warnings


def select(
    rows: Iterable[PodRow], namespace: str | None = None, node: str | None = None
) -> list[PodRow]:
    """Rows of one namespace (None: all) and one node (None: all)."""
    return [
        r
        for r in rows
        if (namespace is None or r.namespace == namespace) and (node is None or r.node == node)
    ]


def order(rows: Iterable[PodRow], key: SortKey = "memory") -> list[PodRow]:
    """Largest first for quantities, alphabetical for names; ties by namespace and pod."""
    by_name = sorted(rows, key=lambda r: (r.namespace, r.pod, r.node))
    if key == "memory":
        return sorted(by_name, key=lambda r: -r.memory_mib)
    if key == "gpus":
        return sorted(by_name, key=lambda r: -len(r.devices))
    if key == "processes":
        return sorted(by_name, key=lambda r: -r.processes)
    if key == "name":
        return sorted(by_name, key=lambda r: (r.pod, r.namespace))
    if key == "node":
        return sorted(by_name, key=lambda r: r.node)
    return by_name


def allocation_text(row: PodRow) -> str:
    """What the pod was handed, compactly: "2" (device plugin), "dra:1" (devices its claims
    got), "share" (a fractional scheduler's), joined by "+"; "0 (none!)" for none at all, "?"
    where its claims cannot be read; "(outside!)" when it uses a device outside them."""
    parts = []
    if "DevicePlugin" in row.allocated_by or (row.requested_gpus and not row.allocated_by):
        parts.append(str(row.requested_gpus))
    if "DRA" in row.allocated_by:
        # allocatedDevices holds the kubelet's devices too when the pod also has a count
        shared = "DevicePlugin" in row.allocated_by
        parts.append("dra" if shared else f"dra:{len(row.allocated_devices) or '?'}")
    if "Fractional" in row.allocated_by:
        parts.append("share")
    if not parts:
        parts.append("0 (none!)" if row.unrequested else ("0" if row.idle_since else "?"))
    return "+".join(parts) + (" (outside!)" if row.unallocated else "")


def render_table(rows: list[PodRow], all_namespaces: bool) -> str:
    """kubectl-style columns. GPUS is what the pod uses, ALLOCATED what it was handed (see
    allocation_text); a pod using GPUs it never got is marked, and so are a pod leaving its
    requested GPUs idle, one holding memory without computing, and a stale node's possibly
    old numbers."""
    header = ["NAMESPACE"] if all_namespaces else []
    header += ["NAME", "NODE", "GPUS", "ALLOCATED", "MEMORY", "PROCESSES", "DEVICES"]
    lines = [header]
    for r in rows:
        memory = format_mib(r.memory_mib) + (" (stale)" if r.stale else "")
        if r.held_idle_since:
            memory += f" (held idle since {r.held_idle_since})"
        cells = [r.namespace] if all_namespaces else []
        requested = allocation_text(r)
        if r.idle_since:
            requested += f" (idle since {r.idle_since})"
        cells += [
            r.pod,
            r.node,
            str(len(r.devices)),
            requested,
            memory,
            str(r.processes),
            ",".join(r.devices),
        ]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def render_json(rows: list[PodRow]) -> str:
    items = [{**asdict(r), "gpus": len(r.devices)} for r in rows]
    return json.dumps({"items": items}, indent=2)
