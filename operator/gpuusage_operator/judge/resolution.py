"""Which pod does each reported process belong to? Pure.

The order of evidence, strongest first:

1. The container ID is in a pod's status: that pod and that container.
2. The pod UID is known: that pod, and the container if its status lists the ID (not yet,
   e.g. right after a container restart: container unknown). Plain pods (no GPU, none of our
   marks) are found this way only: the index keeps no key per container for them.
   Without a UID (a kubelet without per-pod cgroups), the plain pods are searched for the
   container ID.
3. A pod UID no pod in the cluster has: `PodNotFound` (deleted, or not yet seen by the watch).
4. A container ID without a pod: `UnknownContainer` (docker run on the host, a kind node).
5. The agent could not attribute the pid: `Unresolved`, with the agent's reason.
6. Nothing at all: `HostProcess` (Xorg, a monitoring daemon, a job outside Kubernetes).

NVIDIA's own daemons hold GPUs too: the MPS server (`nvidia-cuda-mps-server`, started by the MPS
control daemon for its clients) is listed by NVML as a compute process, in the device plugin's
MPS daemon pod, which requests no GPU. It is `DriverProcess`, never a tenant: on the host, or in
a pod of a namespace where the cluster's GPU components run (`--driver-namespaces`). By name
alone it would be a disguise any tenant could wear, so the same name in a tenant's namespace is
judged as any process is. The MPS clients are listed with their own pids (NVML's MPS list) and
attributed to their own pods like any process.

A pod found by either key is taken only when its `spec.nodeName` is the report's node: a
report speaks for its own node alone (the admission policy lets an agent write only its own
node's report), so a container ID or pod UID of a pod elsewhere, or of a pod not scheduled yet,
is `PodOnOtherNode` and that pod is never touched. Otherwise a compromised or confused agent
could mark any pod in the cluster.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from gpuusage.api.models import GpuNodeUsageSpec, Process
from gpuusage.api.reasons import UnattributedReason
from gpuusage.api.summary import all_processes
from gpuusage_operator.index.pods import PodLookup, PodSnapshot

DRIVER_PROCESSES = frozenset({"nvidia-cuda-mps-server", "nvidia-cuda-mps-control"})
"""Process names of NVIDIA's daemons that hold GPU contexts for others."""
DEFAULT_DRIVER_NAMESPACES = (
    "gpu-operator",
    "nvidia-gpu-operator",
    "nvidia-device-plugin",
    "nvidia-dra-driver-gpu",
    "kube-system",
)


@dataclass(frozen=True)
class Resolution:
    """One (device, process) with its pod, or the reason it has none."""

    device_uuid: str
    process: Process
    pod: PodSnapshot | None
    container_name: str | None = None
    reason: UnattributedReason | None = None
    message: str = ""


def _elsewhere(node: str, device_uuid: str, process: Process, pod: PodSnapshot) -> Resolution:
    where = f"on node {pod.node}" if pod.node else "not scheduled to any node"
    return Resolution(
        device_uuid,
        process,
        None,
        reason="PodOnOtherNode",
        message=f"the process's pod is {where}, not on {node}; "
        "a report can attribute processes only to its own node's pods",
    )


def _driver(device_uuid: str, process: Process, where: str) -> Resolution:
    return Resolution(
        device_uuid,
        process,
        None,
        reason="DriverProcess",
        message=f"NVIDIA's {process.name} ({where}) holds the device for other processes, "
        "whose use is their own pods'",
    )


def resolve_process(
    node: str,
    device_uuid: str,
    process: Process,
    lookup: PodLookup,
    driver_namespaces: Collection[str] = DEFAULT_DRIVER_NAMESPACES,
) -> Resolution:
    """The pod of one process of node's report, or the reason it has none."""
    found = _resolve(node, device_uuid, process, lookup)
    if process.name not in DRIVER_PROCESSES:
        return found
    if found.pod is not None and found.pod.namespace in driver_namespaces:
        return _driver(device_uuid, process, f"pod {found.pod.namespace}/{found.pod.name}")
    if found.reason == "HostProcess":
        return _driver(device_uuid, process, "on the host")
    return found


def _resolve(node: str, device_uuid: str, process: Process, lookup: PodLookup) -> Resolution:
    if process.container_id:
        pod = lookup.by_container(process.container_id)
        if pod is not None:
            if pod.node != node:
                return _elsewhere(node, device_uuid, process, pod)
            return Resolution(device_uuid, process, pod, pod.container_name(process.container_id))
    if process.pod_uid:
        pod = lookup.by_uid(process.pod_uid)
        if pod is not None:
            if pod.node != node:
                return _elsewhere(node, device_uuid, process, pod)
            named = pod.container_name(process.container_id) if process.container_id else None
            return Resolution(device_uuid, process, pod, named)
        return Resolution(
            device_uuid,
            process,
            None,
            reason="PodNotFound",
            message=f"no pod with UID {process.pod_uid}",
        )
    if process.container_id:
        pod = lookup.plain_with_container(process.container_id)
        if pod is not None:
            if pod.node != node:
                return _elsewhere(node, device_uuid, process, pod)
            return Resolution(device_uuid, process, pod, pod.container_name(process.container_id))
        return Resolution(
            device_uuid,
            process,
            None,
            reason="UnknownContainer",
            message=f"container {process.container_id[:12]} belongs to no known pod",
        )
    if process.resolve_error:
        return Resolution(
            device_uuid, process, None, reason="Unresolved", message=process.resolve_error
        )
    return Resolution(
        device_uuid,
        process,
        None,
        reason="HostProcess",
        message="the process runs outside any container",
    )


def resolve_all(
    spec: GpuNodeUsageSpec,
    lookup: PodLookup,
    driver_namespaces: Collection[str] = DEFAULT_DRIVER_NAMESPACES,
) -> Iterator[Resolution]:
    for device_uuid, process in all_processes(spec):
        yield resolve_process(spec.node_name, device_uuid, process, lookup, driver_namespaces)


@dataclass(frozen=True)
class PodUse:
    """One pod's processes on one node's GPUs: the one grouping behind the pod's marks and its
    entries in the report's status."""

    pod: PodSnapshot
    node: str
    observed_at: datetime
    resolutions: tuple[Resolution, ...]

    @property
    def devices(self) -> list[str]:
        return sorted({r.device_uuid for r in self.resolutions})

    @property
    def memory_mib(self) -> int:
        return sum(r.process.used_memory_mib or 0 for r in self.resolutions)


def pod_uses(
    node: str, observed_at: datetime, resolutions: Iterable[Resolution]
) -> dict[str, PodUse]:
    """Resolutions grouped by pod UID, in the order the pods first appear."""
    grouped: dict[str, list[Resolution]] = defaultdict(list)
    snapshots: dict[str, PodSnapshot] = {}
    for r in resolutions:
        if r.pod is not None:
            grouped[r.pod.uid].append(r)
            snapshots[r.pod.uid] = r.pod
    return {
        uid: PodUse(snapshots[uid], node, observed_at, tuple(items))
        for uid, items in grouped.items()
    }
