"""The rows of `gpuusage top`: who holds the GPU memory, like `kubectl top pod`.

Rows come from the operator's work, the `status` of every GpuNodeUsage, so one LIST answers
for the whole cluster and the numbers are exactly what the annotations and alerts say. Pure
functions build and order the rows; the command only fetches and prints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from pydantic import ValidationError

from gpuusage.api import names
from gpuusage.api.announcement import decode
from gpuusage.api.models import GpuNodeUsageStatus, PodAllocation
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
    handed_gpus: int | None = None
    """Whole GPUs it was handed, from the operator's status.allocations (which tells MIG
    slices and shares apart); None where the report has no entry for it (an earlier
    operator, or nothing handed in numbers)."""
    handed_mig_devices: int = 0
    handed_share: float | None = None
    """The fraction of one GPU a fractional scheduler gave it, where its annotation says."""
    idle_since: str | None = None
    """Set for a pod that requested GPUs and has used none since then (status.idlePods)."""
    held_idle: bool = False
    """Its processes hold memory and have computed nothing for the operator's --idle-after."""
    held_idle_since: str | None = None
    """Since when they have, where known (the reports say it; a pod's marks do not)."""
    computing: list[str] = field(default_factory=list)
    """Devices on which it computes (status.pods[].computing: an engine used within the
    agent's --idle-window; devices that do not tell are not listed)."""
    compute_share: float | None = None
    """Its shares of the devices' time added up (status.pods[].computeShare; 1.0 is one
    whole GPU's time); None where no device it uses tells one."""
    share_untold: bool = False
    """Some device it uses tells no share (MIG, MPS clients, too few samples yet)."""
    stale: bool = False
    pending: str = ""
    """A policy's action announced on the pod (its gpuusage.io/policy-action annotation)."""


NodeStatus = tuple[str, GpuNodeUsageStatus]
"""A report's node name and its status, read once for every view of it."""


def read_statuses(reports: Iterable[Mapping[str, Any]]) -> tuple[list[NodeStatus], list[str]]:
    """The statuses of GpuNodeUsage objects, and a warning for each one that cannot be read; a
    report without status yet (the operator has not seen it) is left out."""
    statuses: list[NodeStatus] = []
    warnings: list[str] = []
    for report in reports:
        node = str((report.get("metadata") or {}).get("name", "?"))
        raw = report.get("status")
        if not raw:
            continue
        try:
            statuses.append((node, GpuNodeUsageStatus.model_validate(raw)))
        except ValidationError as exc:
            warnings.append(f"GpuNodeUsage {node}: status unreadable ({exc.error_count()} errors)")
    return statuses, warnings


def pod_rows(reports: Iterable[Mapping[str, Any]]) -> tuple[list[PodRow], list[str]]:
    """Rows from GpuNodeUsage objects, and a warning for each one that cannot be read (see
    rows_of)."""
    statuses, warnings = read_statuses(reports)
    return rows_of(statuses), warnings


def rows_of(statuses: Iterable[NodeStatus]) -> list[PodRow]:
    """A pod that uses several devices is one row; a pod that requested GPUs and leaves them
    idle is a row with no devices."""
    rows: dict[tuple[str, str, str], PodRow] = {}
    for node, status in statuses:
        handed = {a.uid: a for a in status.allocations}
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
            if pod.computing and pod.device_uuid not in row.computing:
                row.computing.append(pod.device_uuid)
            if pod.compute_share is None:
                row.share_untold = True
            else:
                row.compute_share = (row.compute_share or 0.0) + pod.compute_share
            _hand(row, handed.get(pod.uid))
            if pod.held_idle_since is not None:
                row.held_idle = True
                row.held_idle_since = format_time(pod.held_idle_since)
            row.stale = status.stale
        for idle in status.idle_pods:
            key = (node, idle.namespace, idle.name)
            if key not in rows:
                rows[key] = PodRow(
                    idle.namespace,
                    idle.name,
                    node,
                    requested_gpus=idle.requested_gpus,
                    idle_since=format_time(idle.idle_since),
                    stale=status.stale,
                )
                _hand(rows[key], handed.get(idle.uid))
    return list(rows.values())


def _hand(row: PodRow, entry: PodAllocation | None) -> None:
    if entry is not None:
        row.handed_gpus = entry.gpus
        row.handed_mig_devices = entry.mig_devices
        row.handed_share = entry.gpu_share


class Placed(Protocol):
    """A row of `top` or `ps`: where it is."""

    @property
    def namespace(self) -> str | None: ...
    @property
    def node(self) -> str: ...


Row = TypeVar("Row", bound=Placed)


def select(rows: Iterable[Row], namespace: str | None = None, node: str | None = None) -> list[Row]:
    """Rows of one namespace (None: all, and rows of no namespace too) and one node (None:
    all)."""
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


def counted_by_plugin(row: PodRow) -> bool:
    """The pod's device-plugin count is what it was handed (also an older status's pods,
    which name no source)."""
    return "DevicePlugin" in row.allocated_by or (row.requested_gpus > 0 and not row.allocated_by)


def claim_devices(row: PodRow) -> int | None:
    """How many devices its DRA claims got; None without claims, or beside a device-plugin
    count (allocatedDevices then holds the kubelet's devices too)."""
    if "DRA" not in row.allocated_by or "DevicePlugin" in row.allocated_by:
        return None
    return len(row.allocated_devices)


def plugin_text(row: PodRow) -> str:
    """The device plugin's count, with MIG slices counted as what they are ("1 MIG", "1+1
    MIG": a plugin in NVIDIA's single MIG strategy hands slices out as nvidia.com/gpu) where
    the operator's status.allocations says so; beside DRA claims its counts include the
    claims' devices, so the plain count stays."""
    if row.handed_gpus is None or "DRA" in row.allocated_by:
        return str(row.requested_gpus)
    parts = [str(row.handed_gpus)] if row.handed_gpus or not row.handed_mig_devices else []
    if row.handed_mig_devices:
        parts.append(f"{row.handed_mig_devices} MIG")
    return "+".join(parts)


def allocation_text(row: PodRow) -> str:
    """What the pod was handed, compactly: "2" or "1 MIG" (device plugin), "dra:1" (devices
    its claims got), "share" or "share (0.5 GPU)" (a fractional scheduler's), joined by "+";
    "0 (none!)" for none at all, "?" where its claims cannot be read; "(outside!)" when it
    uses a device outside them."""
    parts = []
    if counted_by_plugin(row):
        parts.append(plugin_text(row))
    if "DRA" in row.allocated_by:
        claimed = claim_devices(row)
        parts.append("dra" if claimed is None else f"dra:{claimed or '?'}")
    if "Fractional" in row.allocated_by:
        parts.append("share" + (f" ({row.handed_share:g} GPU)" if row.handed_share else ""))
    if not parts:
        parts.append("0 (none!)" if row.unrequested else ("0" if row.idle_since else "?"))
    return "+".join(parts) + (" (outside!)" if row.unallocated else "")


def share_text(share: float | None, untold: bool = False) -> str:
    """A share of GPU time as top shows CPU: "42%" of one GPU, "150%" over two; "-" where no
    device tells; "+?" after it where some of them do not."""
    if share is None:
        return "-"
    return f"{100 * share:.0f}%" + ("+?" if untold else "")


def columns(lines: list[list[str]]) -> str:
    """Left-aligned columns three spaces apart, as kubectl prints them."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def pending_text(annotation: str | None) -> str:
    """What a pod's announcement says, in a cell: the action and when, or what came of it."""
    shown = decode(annotation)
    if shown is None:
        return ""
    if shown.recorded:
        return f"{shown.action} {'recorded (DryRun)' if shown.mode == 'DryRun' else 'taken'}"
    dry = " (DryRun)" if shown.mode == "DryRun" else ""
    return f"{shown.action} at {format_time(shown.due)}{dry}"


def with_pending(
    rows: Iterable[PodRow], annotations: Mapping[tuple[str, str], Mapping[str, str]]
) -> None:
    """Fill each row's pending action from its pod's annotations, by (namespace, name)."""
    for row in rows:
        found = annotations.get((row.namespace, row.pod)) or {}
        row.pending = pending_text(found.get(names.ANNOTATION_POLICY_ACTION))


def render_table(rows: list[PodRow], all_namespaces: bool) -> str:
    """kubectl-style columns. GPUS is what the pod uses, ALLOCATED what it was handed (see
    allocation_text); a pod using GPUs it never got is marked, and so are a pod leaving its
    requested GPUs idle, one holding memory without computing, and a stale node's possibly
    old numbers."""
    header = ["NAMESPACE"] if all_namespaces else []
    header += ["NAME", "NODE", "GPUS", "ALLOCATED", "MEMORY", "COMPUTE", "PROCESSES", "DEVICES"]
    header += ["PENDING"]
    lines = [header]
    for r in rows:
        memory = format_mib(r.memory_mib) + (" (stale)" if r.stale else "")
        if r.held_idle:
            since = f" since {r.held_idle_since}" if r.held_idle_since else ""
            memory += f" (held idle{since})"
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
            share_text(r.compute_share, r.share_untold),
            str(r.processes),
            ",".join(r.devices) or "<none>",
            r.pending or "<none>",
        ]
        lines.append(cells)
    return columns(lines)


def render_json(rows: list[PodRow], marks_note: str | None = None) -> str:
    """The rows as JSON; read from the pods' marks (not the reports), it says so and what the
    view lacks (see podmarks)."""
    items = [{**asdict(r), "gpus": len(r.devices)} for r in rows]
    seen = {"view": "pod-marks", "note": marks_note} if marks_note is not None else {}
    return json.dumps({"items": items, **seen}, indent=2)


@dataclass
class NamespaceRow:
    """One namespace's GPU use now: what its pods use against what they were handed."""

    namespace: str
    pods: int = 0
    """Pods with processes on a GPU."""
    devices: int = 0
    """GPUs and MIG devices its pods use (a device two of its pods share counts once)."""
    computing: int = 0
    """Of those, the ones on which one of its pods computes (where the device tells)."""
    compute_share: float | None = None
    """Its pods' shares of their devices' time added up (1.0: one whole GPU's time); None
    where no device tells one."""
    share_untold: bool = False
    """Some of its pods use a device that tells no share."""
    memory_mib: int = 0
    allocated_gpus: int = 0
    """Whole GPUs its running pods were handed (device-plugin GPUs, the GPUs DRA claims got),
    in use or not."""
    allocated_mig_devices: int = 0
    """MIG slices its running pods were handed (not counted as GPUs)."""
    shares: int = 0
    """Pods running on a fractional scheduler's share (not counted as whole GPUs)."""
    share_gpus: float = 0.0
    """The fractions of a GPU those shares add up to, where their annotations say it."""
    idle_pods: int = 0
    """Pods leaving requested GPUs idle, or holding memory without computing."""
    unrequested_pods: int = 0
    """Pods using a GPU although they were handed none of any kind (UsingUnrequestedGPU)."""
    unallocated_pods: int = 0
    """Pods that were handed GPUs and use a device outside them (UsingUnallocatedGPU), as the
    reports' totals.unallocatedPods count them; pods handed none are unrequested_pods."""
    stale: bool = False
    """Some of these numbers come from a node whose report is stale."""


def allocated_count(row: PodRow) -> int:
    """Whole GPUs (or MIG slices) the pod was handed, as allocation_text counts them."""
    return (row.requested_gpus if counted_by_plugin(row) else 0) + (claim_devices(row) or 0)


def allocations_by_node(statuses: Iterable[NodeStatus]) -> dict[str, list[PodAllocation]]:
    """What each node's running pods were handed (status.allocations), for the reports whose
    operator lists it; an earlier operator's reports are left out (counted from their pods)."""
    return {
        node: status.allocations
        for node, status in statuses
        if "allocations" in status.model_fields_set
    }


def select_handed(
    handed: Mapping[str, list[PodAllocation]], namespace: str | None = None, node: str | None = None
) -> dict[str, list[PodAllocation]]:
    """What was handed in one namespace (None: all) on one node (None: all), as select picks
    rows."""
    return {
        n: [a for a in entries if namespace in (None, a.namespace)]
        for n, entries in handed.items()
        if node in (None, n)
    }


def namespace_rows(
    rows: Iterable[PodRow], handed: Mapping[str, list[PodAllocation]] | None = None
) -> list[NamespaceRow]:
    """The pod rows summed per namespace; what was handed comes from `handed` (by node) where
    a node's report lists it, else from the rows (which know only pods that use GPUs or were
    judged idle)."""
    handed = handed or {}
    found: dict[str, NamespaceRow] = {}
    devices: dict[str, set[tuple[str, str]]] = {}
    computing: dict[str, set[tuple[str, str]]] = {}
    for r in rows:
        ns = found.setdefault(r.namespace, NamespaceRow(r.namespace))
        if r.devices:
            ns.pods += 1
        devices.setdefault(r.namespace, set()).update((r.node, d) for d in r.devices)
        computing.setdefault(r.namespace, set()).update((r.node, d) for d in r.computing)
        ns.memory_mib += r.memory_mib
        if r.compute_share is not None:
            ns.compute_share = (ns.compute_share or 0.0) + r.compute_share
        ns.share_untold = ns.share_untold or (r.share_untold and bool(r.devices))
        if r.node not in handed:
            ns.allocated_gpus += allocated_count(r)
            ns.shares += "Fractional" in r.allocated_by
        ns.idle_pods += bool(r.idle_since or r.held_idle)
        ns.unrequested_pods += r.unrequested
        ns.unallocated_pods += r.unallocated
        ns.stale = ns.stale or r.stale
    for entries in handed.values():
        for a in entries:
            ns = found.setdefault(a.namespace, NamespaceRow(a.namespace))
            ns.allocated_gpus += a.gpus
            ns.allocated_mig_devices += a.mig_devices
            if a.gpu_share is not None or a.gpu_memory_share_mib is not None:
                ns.shares += 1
                ns.share_gpus += a.gpu_share or 0.0
    for name, used in devices.items():
        found[name].devices = len(used)
        found[name].computing = len(computing[name])
    return sorted(found.values(), key=lambda n: (-n.memory_mib, n.namespace))


def namespace_allocation_text(row: NamespaceRow) -> str:
    """ "2", "2 + 1 MIG", "0 + 1 share (0.5 GPU)": whole GPUs, then what is not one."""
    parts = [str(row.allocated_gpus)]
    if row.allocated_mig_devices:
        parts.append(f"{row.allocated_mig_devices} MIG")
    if row.shares:
        share = f"{row.shares} share{'s' if row.shares != 1 else ''}"
        parts.append(share + (f" ({row.share_gpus:g} GPU)" if row.share_gpus else ""))
    return " + ".join(parts)


def render_namespace_table(
    rows: list[NamespaceRow], extra: tuple[list[str], Mapping[str, list[str]]] | None = None
) -> str:
    """kubectl-style columns, one line a namespace; `extra`: more columns (their header, and
    each namespace's cells), such as the bill over a window."""
    header = ["NAMESPACE", "PODS", "GPUS", "COMPUTING", "COMPUTE", "ALLOCATED", "MEMORY", "IDLE"]
    header += ["UNREQUESTED", "UNALLOCATED"]
    more_header, more = extra or ([], {})
    lines = [header + more_header]
    blank = ["-"] * len(more_header)
    for r in rows:
        memory = format_mib(r.memory_mib) + (" (stale)" if r.stale else "")
        lines.append(
            [
                r.namespace,
                str(r.pods),
                str(r.devices),
                str(r.computing),
                share_text(r.compute_share, r.share_untold),
                namespace_allocation_text(r),
                memory,
                str(r.idle_pods),
                str(r.unrequested_pods),
                str(r.unallocated_pods),
                *more.get(r.namespace, blank),
            ]
        )
    return columns(lines)


def render_namespace_json(rows: list[NamespaceRow]) -> str:
    return json.dumps({"items": [asdict(r) for r in rows]}, indent=2)
