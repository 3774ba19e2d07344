"""The rows of `gpuusage top` and `ps` from the pods' own marks, for a user who may read the
pods of a namespace but not the cluster-scoped GpuNodeUsage reports. Pure.

The operator writes on every pod it finds using a GPU what the pod uses (the annotations
gpuusage.io/gpus, gpu-memory-mib and usage) and its verdict (the gpuusage.io/GPUInUse
condition). A namespace's pods so tell their own use to whoever may read them, without the
reports, which list every tenant's processes and commands. What only the reports hold is left
out, and `marks_note` says what that is.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpuusage.api import names
from gpuusage.api.resources import is_gpu_resource
from gpuusage.api.summary import format_mib
from gpuusage.api.usage import Usage, decode_usage
from gpuusage_commands.pstable import PsSortKey
from gpuusage_commands.toptable import PodRow, columns, pending_text

TOP_LACKS = (
    "processes of no pod, other namespaces, what DRA claims and schedulers' shares handed, and "
    "since when a pod holds memory idle"
)
"""What `top` shows from the reports and cannot from the pods' marks."""
PS_LACKS = (
    "processes of no pod, other namespaces, and each process's command, own memory, activity "
    "and device number"
)
"""What `ps` shows from the reports and cannot from the pods' marks."""


def marks_note(namespace: str, lacks: str) -> str:
    """One line saying where the rows come from, and what they lack."""
    return (
        f"no right to list {names.PLURAL}: namespace {namespace} as its pods' own marks tell it "
        f"(the {names.GROUP}/ annotations, the GPUInUse condition); only the reports show "
        f"{lacks}"
    )


def nothing_shown(namespace: str, pods: Iterable[Mapping[str, Any]], nothing: str, on: str) -> str:
    """The line for a view from the pods' marks that has no row: `nothing` ("No GPU processes")
    in the namespace (`on`: " on node N", or ""). Where pods ask for GPUs and none carries the
    operator's marks, that is not said: the operator may observe only (--no-pod-marks) or keep
    the namespace outside its --namespace-selector, and the pods use GPUs all the same."""
    pods = list(pods)
    if any(_carries_marks(pod) for pod in pods) or not any(_asks_for_gpus(p) for p in pods):
        return f"{nothing} in namespace {namespace}{on}."
    return (
        f"None of the pods in namespace {namespace} carries gpuusage's marks: the operator "
        f"may observe only (operator.podMarks=false), or {namespace} may be outside its "
        f"--namespace-selector. The reports (ClusterRole gpuusage-viewer) show the use."
    )


def _asks_for_gpus(pod: Mapping[str, Any]) -> bool:
    """A GPU limit (the device plugins' resources) or a ResourceClaim (DRA)."""
    spec = pod.get("spec") or {}
    return _gpu_limits(spec) > 0 or bool(spec.get("resourceClaims"))


def _carries_marks(pod: Mapping[str, Any]) -> bool:
    marks = read_marks(pod)
    return marks.status is not None or any(
        k in names.OPERATOR_ANNOTATIONS for k in marks.annotations
    )


@dataclass(frozen=True)
class Marks:
    """What one pod carries of ours, and where it runs."""

    namespace: str
    name: str
    node: str
    annotations: Mapping[str, str]
    usage: Usage | None
    """Its usage annotation, read; None where absent or not of the operator's shape."""
    status: str | None
    """The GPUInUse condition's status (None: no condition)."""
    reason: str | None
    since: str | None
    """When the condition's status last changed."""
    gpu_limits: int
    """The GPUs its containers' limits ask of a device plugin (nvidia.com/gpu, MIG)."""
    claims: bool
    """It names DRA ResourceClaims."""

    @property
    def devices(self) -> list[str]:
        return [d for d in (self.annotations.get(names.ANNOTATION_GPUS) or "").split(",") if d]

    @property
    def memory_mib(self) -> int:
        text = self.annotations.get(names.ANNOTATION_GPU_MEMORY_MIB) or ""
        return int(text) if text.isdigit() else 0

    @property
    def who(self) -> str:
        return f"{self.namespace}/{self.name}"


def _gpu_limits(spec: Mapping[str, Any]) -> int:
    total = 0
    for container in spec.get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        for resource, quantity in limits.items():
            if is_gpu_resource(resource) and str(quantity).isdigit():
                total += int(quantity)
    return total


def read_marks(pod: Mapping[str, Any]) -> Marks:
    """A pod as the API lists it (JSON), read for its marks."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
    usage = decode_usage(annotations.get(names.ANNOTATION_USAGE))
    conditions = (pod.get("status") or {}).get("conditions") or []
    ours: Mapping[str, Any] = next(
        (c for c in conditions if c.get("type") == names.POD_CONDITION_GPU_IN_USE), {}
    )
    return Marks(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node=str(spec.get("nodeName") or (usage.node if usage else None) or "?"),
        annotations=annotations,
        usage=usage,
        status=ours.get("status"),
        reason=ours.get("reason"),
        since=ours.get("lastTransitionTime"),
        gpu_limits=_gpu_limits(spec),
        claims=bool(spec.get("resourceClaims")),
    )


def _unreadable(marks: Marks) -> str | None:
    """A warning for a pod whose usage annotation cannot be read, or shows a part only."""
    if names.ANNOTATION_USAGE in marks.annotations and marks.usage is None:
        return f"pod {marks.who}: its {names.ANNOTATION_USAGE} annotation cannot be read"
    if marks.usage is not None and marks.usage.truncated:
        return f"pod {marks.who}: its {names.ANNOTATION_USAGE} annotation was shortened: a part"
    return None


def top_row(marks: Marks) -> PodRow | None:
    """The pod's row in `top`: its use, or its requested GPUs left idle; None for a pod that
    neither uses a GPU nor is flagged for leaving its GPUs idle."""
    idle = marks.status == "False" and marks.reason == "RequestedGPUsIdle"
    devices = marks.devices
    if not devices and not idle:
        return None
    usage = marks.usage
    requested = usage.requested_gpus if usage is not None and devices else marks.gpu_limits
    row = PodRow(
        marks.namespace,
        marks.name,
        marks.node,
        devices=devices,
        memory_mib=marks.memory_mib,
        processes=(usage.processes() or 0) if usage is not None else 0,
        requested_gpus=requested,
        allocated_by=(["DevicePlugin"] if requested else []) + (["DRA"] if marks.claims else []),
        unrequested=marks.reason == "UsingUnrequestedGPU",
        unallocated=marks.reason == "UsingUnallocatedGPU",
        held_idle=marks.reason == "HoldingIdleGPU",
        idle_since=marks.since if idle and not devices else None,
        stale=marks.status == "Unknown",
        pending=pending_text(marks.annotations.get(names.ANNOTATION_POLICY_ACTION)),
    )
    for container in usage.containers if usage is not None else ():
        for device in container.devices:
            if device.share is None:
                row.share_untold = True
            else:
                row.compute_share = (row.compute_share or 0.0) + device.share
    return row


def top_rows(pods: Iterable[Mapping[str, Any]]) -> tuple[list[PodRow], list[str]]:
    """Rows of `top` from pods, and a warning for each pod whose marks show a part only."""
    rows: list[PodRow] = []
    warnings: list[str] = []
    for pod in pods:
        marks = read_marks(pod)
        row = top_row(marks)
        if row is None:
            continue
        rows.append(row)
        if (warning := _unreadable(marks)) is not None:
            warnings.append(warning)
    return rows, warnings


@dataclass(frozen=True)
class MarkedProcesses:
    """One container's processes on one device, as its pod's usage annotation lists them."""

    node: str
    namespace: str
    pod: str
    container: str
    device_uuid: str
    pids: tuple[int, ...] | None
    """None where the operator left them out of a long annotation."""
    memory_mib: int
    """What they hold on the device together (the annotation has no figure per process)."""
    compute_share: float | None
    stale: bool
    """The pod's GPUInUse is Unknown: this is its last known use."""


def process_rows(pods: Iterable[Mapping[str, Any]]) -> tuple[list[MarkedProcesses], list[str]]:
    """Rows of `ps` from pods, and a warning for each pod whose marks show a part only."""
    rows: list[MarkedProcesses] = []
    warnings: list[str] = []
    for pod in pods:
        marks = read_marks(pod)
        if not marks.devices:
            continue
        if (warning := _unreadable(marks)) is not None:
            warnings.append(warning)
        for container in marks.usage.containers if marks.usage is not None else ():
            rows += [
                MarkedProcesses(
                    node=marks.node,
                    namespace=marks.namespace,
                    pod=marks.name,
                    container=container.name,
                    device_uuid=device.uuid,
                    pids=device.pids,
                    memory_mib=device.mib,
                    compute_share=device.share,
                    stale=marks.status == "Unknown",
                )
                for device in container.devices
            ]
    return rows, warnings


def order_marked(rows: Iterable[MarkedProcesses], key: PsSortKey) -> list[MarkedProcesses]:
    """As `ps` orders processes: quantities largest first (unknown last), names in order; ties
    by node, pod, container and device."""
    place = sorted(rows, key=lambda r: (r.node, r.pod, r.container, r.device_uuid))
    if key == "memory":
        return sorted(place, key=lambda r: -r.memory_mib)
    if key == "share":
        return sorted(
            place, key=lambda r: -(r.compute_share if r.compute_share is not None else -1)
        )
    if key == "pid":
        return sorted(place, key=lambda r: min(r.pids) if r.pids else 1 << 32)
    if key == "pod":
        return sorted(place, key=lambda r: (r.namespace, r.pod))
    return place


def render_marked(rows: list[MarkedProcesses]) -> str:
    """kubectl-style columns, one line a container and device (the pids it runs there)."""
    lines = [["NODE", "DEVICE", "PIDS", "POD", "CONTAINER", "MEMORY", "SHARE"]]
    for r in rows:
        lines.append(
            [
                r.node + (" (stale)" if r.stale else ""),
                r.device_uuid,
                ",".join(map(str, r.pids)) if r.pids is not None else "?",
                r.pod,
                r.container,
                format_mib(r.memory_mib),
                f"{100 * r.compute_share:.0f}%" if r.compute_share is not None else "-",
            ]
        )
    return columns(lines)


def render_marked_json(rows: list[MarkedProcesses], said: str) -> str:
    return json.dumps(
        {"items": [asdict(r) for r in rows], "view": "pod-marks", "note": said}, indent=2
    )


def show_marked(
    output: str,
    said: str,
    warnings: list[str],
    *,
    as_json: Callable[[], str],
    table: Callable[[], str] | None,
    empty: str,
) -> int:
    """Print a view from the pods' marks as `top` and `ps` do: the warnings, then the JSON, or
    the note and the table (`table` None: nothing to show, `empty` says so)."""
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if output == "json":
        print(as_json())
        return 0
    print(f"note: {said}", file=sys.stderr)
    if table is None:
        print(empty, file=sys.stderr)
        return 0
    print(table())
    return 0
