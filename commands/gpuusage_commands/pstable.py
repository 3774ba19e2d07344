"""The rows of `gpuusage ps`: every GPU process, as `nvidia-smi` lists them on one machine.

A row is one process on one device: the agent's view of it (`spec`: pid, command, memory,
compute share, activity) joined with the operator's (`status`: which namespace, pod and
container it runs in, or why it belongs to no pod). Pure functions build, choose, order and
render the rows; the command only fetches and prints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import ValidationError

from gpuusage.api.activity import Activity, process_activity
from gpuusage.api.models import GpuNodeUsageSpec, GpuNodeUsageStatus, Process, UnattributedProcess
from gpuusage.api.summary import all_processes, device_uuid, format_mib
from gpuusage.api.times import format_time
from gpuusage_commands.toptable import columns

PsSortKey = Literal["memory", "share", "pid", "node", "pod"]


@dataclass(frozen=True)
class ProcessRow:
    """One process on one device of one node."""

    node: str
    device: str
    """The device as nvidia-smi numbers it: the GPU's index, a MIG device's `<gpu>:<mig>`."""
    device_uuid: str
    pid: int
    command: str
    memory_mib: int | None
    compute_share: float | None
    activity: Activity
    idle_since: str | None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    container_id: str | None = None
    no_pod: str | None = None
    """Why it belongs to no pod (a status reason: HostProcess, DriverProcess, Unresolved, ...);
    None for a pod's process, and for one the operator has not resolved yet (shown
    `<pending>`)."""
    no_pod_detail: str = ""
    sm_percent: int | None = None
    share_samples: int | None = None
    share_seconds: float | None = None
    stale: bool = False
    """The node's report is stale: the process may have ended, others may have started."""


@dataclass(frozen=True)
class NodeNote:
    """What a node's rows cannot show: a stale report, processes past the report's bound."""

    node: str
    text: str


def _devices(spec: GpuNodeUsageSpec) -> list[tuple[str, str, int | None]]:
    """(UUID, number as nvidia-smi gives it, processes past the report's bound) of every
    device, by the UUID the operator's status names it (see summary.device_uuid)."""
    found: list[tuple[str, str, int | None]] = []
    for gpu in spec.gpus:
        found.append((device_uuid(gpu), str(gpu.index), gpu.omitted_processes))
        found += [(m.uuid, f"{gpu.index}:{m.index}", m.omitted_processes) for m in gpu.mig_devices]
    return found


Owner = tuple[str, str, str | None]
"""A process's namespace, pod and container (None: not listed)."""


@dataclass(frozen=True)
class Owners:
    """Whose each process is, from the operator's status."""

    by_pid: dict[tuple[str, int], tuple[str, Owner]]
    """(device, pid) → (pod UID, owner): the pids the status lists (a container's first few)."""
    by_pod: dict[tuple[str, str], Owner]
    """(device, pod UID) → owner without the container: for the pids past that list."""
    none: dict[tuple[str, int], UnattributedProcess]
    """(device, pid) → the entry saying why it belongs to no pod."""

    def of(self, device: str, process: Process) -> Owner | None:
        """The process's owner; a listed pid counts only for the pod the agent attributed it
        to (a pid reused since the status was written belongs to its new pod)."""
        listed = self.by_pid.get((device, process.pid))
        if listed is not None and process.pod_uid in (None, listed[0]):
            return listed[1]
        if process.pod_uid is not None:
            return self.by_pod.get((device, process.pod_uid))
        return None


def _owners(status: GpuNodeUsageStatus | None) -> Owners:
    owners = Owners({}, {}, {})
    if status is None:
        return owners
    for entry in status.pods:
        owners.by_pod[(entry.device_uuid, entry.uid)] = (entry.namespace, entry.name, None)
        for container in entry.containers:
            for pid in container.pids:
                owner = (entry.namespace, entry.name, container.name)
                owners.by_pid[(entry.device_uuid, pid)] = (entry.uid, owner)
    for unattributed in status.unattributed:
        owners.none[(unattributed.device_uuid, unattributed.pid)] = unattributed
    return owners


def read_report(report: Mapping[str, Any]) -> tuple[list[ProcessRow], list[NodeNote], str | None]:
    """The rows of one GpuNodeUsage object, what they cannot show, and a warning where the
    report cannot be read (then no rows)."""
    node = str((report.get("metadata") or {}).get("name", "?"))
    try:
        spec = GpuNodeUsageSpec.model_validate(report.get("spec") or {})
        status = (
            GpuNodeUsageStatus.model_validate(report["status"]) if report.get("status") else None
        )
    except ValidationError as exc:
        return [], [], f"GpuNodeUsage {node}: unreadable ({exc.error_count()} errors)"
    stale = bool(status and status.stale)
    owners = _owners(status)
    devices = _devices(spec)
    number = {uuid: shown for uuid, shown, _ in devices}
    rows: list[ProcessRow] = []
    for uuid, process in all_processes(spec):
        owner = owners.of(uuid, process)
        why = owners.none.get((uuid, process.pid)) if owner is None else None
        rows.append(
            ProcessRow(
                node=node,
                device=number[uuid],
                device_uuid=uuid,
                pid=process.pid,
                command=process.name or "?",
                memory_mib=process.used_memory_mib,
                compute_share=process.compute_share,
                activity=process_activity(process),
                idle_since=format_time(process.idle_since) if process.idle_since else None,
                namespace=owner[0] if owner else None,
                pod=owner[1] if owner else None,
                container=owner[2] if owner else None,
                container_id=process.container_id,
                no_pod=why.reason if why is not None else None,
                no_pod_detail=why.message if why is not None else "",
                sm_percent=process.sm_util_percent,
                share_samples=process.compute_share_samples,
                share_seconds=process.compute_share_seconds,
                stale=stale,
            )
        )
    notes: list[NodeNote] = []
    if stale:
        notes.append(
            NodeNote(node, f"{node}: the report is stale: processes may have ended or started")
        )
    if status is None and rows:
        notes.append(NodeNote(node, f"{node}: the operator has not resolved these processes yet"))
    generation = (report.get("metadata") or {}).get("generation")
    if status is not None and generation is not None and status.observed_generation != generation:
        notes.append(
            NodeNote(
                node, f"{node}: the owners are from an earlier report (the operator is behind)"
            )
        )
    notes += [
        NodeNote(node, f"{node}: device {shown}: {omitted} more processes not listed")
        for _, shown, omitted in devices
        if omitted
    ]
    return rows, notes, None


def read_reports(
    reports: Iterable[Mapping[str, Any]],
) -> tuple[list[ProcessRow], list[NodeNote], list[str]]:
    """Every report's rows and notes, and a warning for each report that cannot be read."""
    rows: list[ProcessRow] = []
    notes: list[NodeNote] = []
    warnings: list[str] = []
    for report in reports:
        found, noted, warning = read_report(report)
        rows += found
        notes += noted
        if warning:
            warnings.append(warning)
    return rows, notes, warnings


def order_processes(rows: Iterable[ProcessRow], key: PsSortKey = "memory") -> list[ProcessRow]:
    """Quantities largest first (unknown last), names in order; ties by node, device, pid."""
    place = sorted(rows, key=lambda r: (r.node, r.device, r.pid))
    if key == "memory":
        return sorted(place, key=lambda r: -(r.memory_mib if r.memory_mib is not None else -1))
    if key == "share":
        return sorted(
            place, key=lambda r: -(r.compute_share if r.compute_share is not None else -1)
        )
    if key == "pid":
        return sorted(place, key=lambda r: r.pid)
    if key == "pod":
        return sorted(place, key=lambda r: (r.namespace or "\uffff", r.pod or "\uffff"))
    return place


def activity_text(row: ProcessRow) -> str:
    """What the process does on its device's engines, as far as the driver can tell."""
    if row.activity == "idle":
        return f"idle since {row.idle_since}"
    return row.activity


def _owner_cells(row: ProcessRow) -> tuple[str, str]:
    """The pod and container cells: a process of no pod shows why, in angle brackets."""
    if row.pod is not None:
        return row.pod, row.container or "-"
    return f"<{row.no_pod or 'pending'}>", "<none>"


def render_processes(rows: list[ProcessRow], namespaces: bool, wide: bool = False) -> str:
    """kubectl-style columns; NAMESPACE where several may show, and with `wide` the device's
    UUID, the container's ID, the latest SM sample and what the share rests on."""
    header = ["NODE", "GPU", "PID", "COMMAND"] + (["NAMESPACE"] if namespaces else [])
    header += ["POD", "CONTAINER", "MEMORY", "SHARE", "ACTIVITY"]
    if wide:
        header += ["DEVICE", "CONTAINER-ID", "SM", "SHARE-BASIS", "DETAIL"]
    lines = [header]
    for r in rows:
        pod, container = _owner_cells(r)
        cells = [r.node + (" (stale)" if r.stale else ""), r.device, str(r.pid), r.command]
        cells += [r.namespace or "<none>"] if namespaces else []
        cells += [
            pod,
            container,
            format_mib(r.memory_mib) if r.memory_mib is not None else "?",
            f"{100 * r.compute_share:.0f}%" if r.compute_share is not None else "-",
            activity_text(r),
        ]
        if wide:
            basis = (
                f"{r.share_samples} samples/{r.share_seconds:.0f}s"
                if r.share_samples is not None and r.share_seconds is not None
                else "-"
            )
            cells += [
                r.device_uuid,
                (r.container_id or "")[:13] or "<none>",
                f"{r.sm_percent}%" if r.sm_percent is not None else "-",
                basis,
                r.no_pod_detail or "-",
            ]
        lines.append(cells)
    return columns(lines)


def render_processes_json(rows: list[ProcessRow], notes: list[NodeNote]) -> str:
    return json.dumps(
        {"items": [asdict(r) for r in rows], "notes": [asdict(n) for n in notes]}, indent=2
    )
