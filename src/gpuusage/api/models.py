"""The GpuNodeUsage API as pydantic models: the one source of truth for the CRD schema.

The class docstrings and field descriptions become the schema's descriptions, so they are written
for the person reading `kubectl explain gpunodeusage.spec`. Bounds (patterns, maxima, maxItems)
are chosen so that the apiserver rejects malformed reports with a message naming the field, and
so that one object can never grow past etcd's object size limit.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from gpuusage.api import names
from gpuusage.api.reasons import BlindReason, SourceReason, UnattributedReason

_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
GPU_UUID_PATTERN = f"^GPU-{_UUID}$"
# R470+ drivers name MIG devices MIG-<uuid>; older ones MIG-GPU-<uuid>/<gi>/<ci> (instance IDs
# are small: a GPU has at most 7 GPU instances; five digits leave room and bound the length).
_INSTANCES = "/[0-9]{1,5}/[0-9]{1,5}"
MIG_UUID_PATTERN = f"^MIG-({_UUID}|GPU-{_UUID}{_INSTANCES})$"
CONTAINER_ID_PATTERN = "^[0-9a-f]{64}$"
POD_UID_PATTERN = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
# metav1.Condition's own validation, copied so that our conditions pass it everywhere.
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# Free text the agent writes: printable ASCII without the characters JSON encoders escape to six
# bytes (" & < > \\), so that a field's bytes equal its characters and the size bound holds.
SAFE_TEXT_PATTERN = r"^[ !#-%'-;=?-\[\]-~]*$"
_UNSAFE = re.compile(r"[^ !#-%'-;=?-\[\]-~]")
DEVICE_ID_PATTERN = r"^[A-Za-z0-9/-]+$"  # GPU-…, MIG-…, or a stand-in such as gpu-index-3
KUBELET_DEVICE_PATTERN = f"^(GPU-{_UUID}|MIG-({_UUID}|GPU-{_UUID}{_INSTANCES}))$"
RESOURCE_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

# Bounds, chosen so that the largest object the schema admits, spec and status together, stays
# well under etcd's default request limit of 1.5 MiB (tests/test_api_on_cluster.py writes it):
# the agent publishes at most MAX_PROCESSES processes per node (the largest by memory; the rest
# are counted per device as omitted), and every list of the status is bounded by that.
MAX_GPUS = 32
MAX_MIG_DEVICES = 8  # NVIDIA GPUs offer at most 7 MIG devices
MAX_PROCESSES = 512  # per device, and on the whole node
MAX_DEVICES = MAX_GPUS * (1 + MAX_MIG_DEVICES)
MAX_POD_DEVICES = MAX_PROCESSES  # each (pod, device) entry stands for at least one process
MAX_UNATTRIBUTED = 64  # processes of no pod listed (the rest counted)
MAX_IDLE_PODS = 64
MAX_ALLOCATIONS = 64  # pods handed GPUs on one node, listed for showback (the rest counted)
MAX_SHARE = 64.0  # a scheduler's share of GPUs, at most (fractions of one GPU, usually)
MAX_CONDITIONS = 4  # Ready and Stale, and room for two more
MAX_PIDS_LISTED = 16  # per container entry of the status
MAX_MIG_UUID = 64  # MIG-GPU-<uuid>/<gi>/<ci> is at most 56 characters
MAX_DEVICE_ID = MAX_MIG_UUID  # no GPU, MIG device, stand-in or <parent>/<profile> is longer
MAX_KUBELET_PODS = 64  # pods listed with the kubelet's devices (the rest counted as omitted)
MAX_KUBELET_DEVICES = 256  # devices listed for those pods, in all
MAX_KUBELET_CLAIM_DEVICES = 32  # DRA devices listed for those pods, in all
MAX_POD_CLAIM_DEVICES = 16  # DRA devices listed for one pod
MAX_ALLOCATED_LISTED = 256  # allocated devices listed in status.pods, in all
MAX_COUNTED = 1_000_000  # counts of things not listed are shown up to this
MAX_REQUESTED_GPUS = 1024  # what a pod's request is shown as, at most
MAX_PID = 4_194_304  # PID_MAX_LIMIT on 64-bit Linux
MAX_MIB = 16 * 1024 * 1024  # 16 TiB: far above any device, low enough to catch unit mistakes


class ApiModel(BaseModel):
    """Base: camelCase on the wire, snake_case in Python, unknown fields ignored on read.

    Ignoring unknown fields lets an older operator read a report written by a newer agent.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        use_attribute_docstrings=True,
    )

    def to_api(self) -> dict[str, Any]:
        """The JSON-ready dict as the apiserver stores it (camelCase, nulls kept)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_patch(self) -> dict[str, Any]:
        """The body of a JSON merge patch: nulls and defaults left out inside lists, which a
        merge patch replaces whole (a reader's defaults fill them in again; the CRD declares
        none, so the apiserver stores them left out), and kept outside them, where a null is
        how a merge patch removes a field written before."""
        lean = self.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        compacted: dict[str, Any] = _lists_from(self.to_api(), lean)
        return compacted


def _lists_from(full: dict[str, Any], lean: dict[str, Any]) -> dict[str, Any]:
    """`full` with every list taken from `lean` (a dump without defaults) and its nulls left
    out; a list missing from `lean` is its default, as in `full`."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        if isinstance(value, dict):
            out[key] = _lists_from(value, lean.get(key) or {})
        elif isinstance(value, list):
            out[key] = _without_nulls(lean.get(key, value))
        else:
            out[key] = value
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def at_most(listed: int, bound: int, what: str) -> None:
    """A bound on a whole object, as the CRD's rules state it (see api.crd): per-list bounds
    multiply, the object's size needs one across lists."""
    if listed > bound:
        raise ValueError(f"{listed} {what} listed; a report lists at most {bound}")


def safe_text(text: str, limit: int) -> str:
    """`text` made fit for a SAFE_TEXT_PATTERN field of `limit` characters: every other
    character becomes "?" (names and messages from /proc, NVML or paths can hold anything)."""
    return _UNSAFE.sub("?", text[:limit])


Percent = Annotated[int, Field(ge=0, le=100)]
MiB = Annotated[int, Field(ge=0, le=MAX_MIB)]
Share = Annotated[float, Field(ge=0, le=1)]
"""A share of a device's time, from 0 to 1."""
ProductName = Annotated[str, Field(max_length=96, pattern=SAFE_TEXT_PATTERN)]  # NVML's buffer
ProcessName = Annotated[str, Field(max_length=64, pattern=SAFE_TEXT_PATTERN)]
ShortText = Annotated[str, Field(max_length=64, pattern=SAFE_TEXT_PATTERN)]
MAX_DETAIL = 256
Detail = Annotated[str, Field(max_length=MAX_DETAIL, pattern=SAFE_TEXT_PATTERN)]
MAX_MESSAGE = 1024
Message = Annotated[str, Field(max_length=MAX_MESSAGE, pattern=SAFE_TEXT_PATTERN)]
DeviceId = Annotated[str, Field(max_length=MAX_DEVICE_ID, pattern=DEVICE_ID_PATTERN)]
Namespace = Annotated[str, Field(max_length=63, pattern=DNS_LABEL_PATTERN)]
PodName = Annotated[str, Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
AllocationSource = Literal["DevicePlugin", "DRA", "Fractional"]
MAX_ALLOCATED = 16
AllocatedDeviceId = Annotated[str, Field(max_length=MAX_DEVICE_ID, pattern=SAFE_TEXT_PATTERN)]
KubeletDeviceId = Annotated[str, Field(max_length=MAX_DEVICE_ID, pattern=KUBELET_DEVICE_PATTERN)]
MAX_RESOURCE_NAME = 48  # nvidia.com/mig-7g.80gb and every vendor name seen are far shorter
ResourceName = Annotated[str, Field(max_length=MAX_RESOURCE_NAME, pattern=RESOURCE_NAME_PATTERN)]

RequestedGpus = Annotated[
    int, Field(ge=0, le=MAX_REQUESTED_GPUS), BeforeValidator(lambda n: min(n, MAX_REQUESTED_GPUS))
]
"""A pod's GPU request as shown: larger requests (nonsense, but the pod API allows them) are
shown as the bound, the one place they are clamped."""

ProcessType = Literal["compute", "graphics", "mps"]


class Memory(ApiModel):
    """Device memory in MiB (1 MiB = 1,048,576 bytes), as NVML reports it."""

    total_mib: MiB = Field(alias="totalMiB")
    """Memory the device offers to processes."""
    used_mib: MiB | None = Field(default=None, alias="usedMiB")
    """Memory in use on the device, by all processes and the driver; null when unknown."""
    reserved_mib: MiB | None = Field(default=None, alias="reservedMiB")
    """Part of usedMiB the driver and firmware reserve for themselves (NVML's memory info v2);
    null where the driver does not tell (older than R510) or the source is not NVML."""


class Utilization(ApiModel):
    """Utilization over NVML's last sample period (1/6 s to 1 s depending on the product)."""

    gpu_percent: Percent | None = None
    """Percent of time one or more kernels ran."""
    memory_percent: Percent | None = None
    """Percent of time device memory was read or written."""


class DeviceError(ApiModel):
    """Why a device could not be read completely. The other devices are still reported."""

    reason: Annotated[str, Field(pattern=CONDITION_REASON_PATTERN, max_length=64)]
    """NVML's error class without the prefix, e.g. GpuIsLost, NoPermission, NotSupported."""
    message: Detail
    """Human-readable detail."""


class Process(ApiModel):
    """One process using a GPU or MIG device, attributed to its container and pod."""

    pid: Annotated[int, Field(ge=1, le=MAX_PID)]
    """Process ID in the host's PID namespace (NVML always reports host PIDs)."""
    name: ProcessName | None = None
    """Executable name (NVML's process name or /proc/<pid>/comm); never the command line."""
    used_memory_mib: MiB | None = Field(default=None, alias="usedMemoryMiB")
    """Device memory used by this process; null when NVML cannot tell (e.g. on Windows WDDM or
    without permission)."""
    container_id: Annotated[str, Field(pattern=CONTAINER_ID_PATTERN)] | None = Field(
        default=None, alias="containerID"
    )
    """Container ID as bare lowercase hex (no runtime:// prefix); null outside any container."""
    pod_uid: Annotated[str, Field(pattern=POD_UID_PATTERN)] | None = Field(
        default=None, alias="podUID"
    )
    """UID of the pod the process runs in; null outside any pod."""
    types: Annotated[list[ProcessType], Field(max_length=3)] = Field(default_factory=list)
    """NVML process lists the process appeared in: compute, graphics, mps."""
    sm_util_percent: Percent | None = None
    """Streaming-multiprocessor utilization in the process's latest sample since the agent's
    last cycle: one instant's value, not an average (the driver samples one process at a
    time); absent when no sample named it or the device reports none."""
    memory_util_percent: Percent | None = None
    """Memory-controller utilization in the same sample as smUtilPercent."""
    compute_share: Share | None = None
    """The share of its device's time, over the agent's --share-window, in which the driver's
    samples found this process on the engines: of wall time, so a device's shares add up to at
    most its busy time. 0 for a process the samples never found on a device sampled long
    enough; absent where the driver cannot tell (MIG devices, MPS clients, whose samples go to
    the server, GPUs without per-process utilization), while the reads cover less than half the
    window, or with the share turned off."""
    compute_share_samples: Annotated[int, Field(ge=0)] | None = None
    """What computeShare rests on: how many of the driver sampler's instants in the window the
    agent's reads covered (for a device's only process, how many readings of the device's
    utilization meter)."""
    compute_share_seconds: Annotated[float, Field(ge=0)] | None = None
    """The span computeShare rests on, in seconds."""
    resolve_error: Detail | None = None
    """Why the process could not be attributed (e.g. it exited during the observation)."""
    idle_since: datetime | None = None
    """Since when the process has used none of the device's engines (SMs, memory controller,
    encoder, decoder; by the node's clock), once that has lasted the agent's --idle-window and
    the driver's samples since make a missed busy process improbable; absent while it works,
    and where per-process utilization is not reported (MIG devices, MPS clients, some GPUs)."""
    activity_unknown: bool = False
    """True where it is not known whether this process uses its engines: the device does not
    say (MIG devices, MPS clients, GPUs without per-process utilization, a failed read), or the
    process has been quiet for the window on a GPU so shared that the driver's sampler cannot
    vouch for it yet. It is then neither idle nor computing, only holding memory."""


class MigDevice(ApiModel):
    """A Multi-Instance GPU device: a slice of a GPU with its own memory and processes."""

    index: Annotated[int, Field(ge=0, le=MAX_MIG_DEVICES)]
    """Index of the MIG device on its parent GPU."""
    uuid: Annotated[str, Field(pattern=MIG_UUID_PATTERN, max_length=MAX_MIG_UUID)]
    """MIG device UUID, as device plugins and NVIDIA_VISIBLE_DEVICES name it."""
    name: ProductName | None = None
    """Product name including the profile, e.g. "NVIDIA A100-SXM4-40GB MIG 1g.5gb"."""
    gpu_instance_id: Annotated[int, Field(ge=0)] | None = None
    compute_instance_id: Annotated[int, Field(ge=0)] | None = None
    memory: Memory | None = None
    processes: Annotated[list[Process], Field(max_length=MAX_PROCESSES)] = Field(
        default_factory=list
    )
    omitted_processes: Annotated[int, Field(ge=0)] | None = None
    """Processes left out of `processes` to keep the report within its bounds (the smallest by
    memory); null when none was."""
    omitted_memory_mib: MiB | None = Field(default=None, alias="omittedMemoryMiB")
    """Memory the omitted processes use."""
    error: DeviceError | None = None


class Gpu(ApiModel):
    """One physical GPU with its processes and, when MIG is enabled, its MIG devices."""

    index: Annotated[int, Field(ge=0, le=MAX_GPUS)]
    """NVML device index (may differ from CUDA_VISIBLE_DEVICES order)."""
    uuid: Annotated[str, Field(pattern=GPU_UUID_PATTERN)] | None
    """GPU UUID, as device plugins and NVIDIA_VISIBLE_DEVICES name it; null only when the GPU
    failed before its UUID could ever be read (see error)."""
    name: ProductName | None = None
    """Product name, e.g. "NVIDIA H100 80GB HBM3"."""
    pci_bus_id: ShortText | None = Field(default=None, alias="pciBusID")
    minor_number: Annotated[int, Field(ge=0, le=254)] | None = None
    """The device node's minor number (/dev/nvidia<minor>), which some device plugins use as
    the device's ID."""
    memory: Memory | None = None
    utilization: Utilization | None = None
    mig_enabled: bool | None = None
    """Whether MIG mode is on; processes are then listed under migDevices."""
    mig_devices: Annotated[list[MigDevice], Field(max_length=MAX_MIG_DEVICES)] = Field(
        default_factory=list
    )
    processes: Annotated[list[Process], Field(max_length=MAX_PROCESSES)] = Field(
        default_factory=list
    )
    omitted_processes: Annotated[int, Field(ge=0)] | None = None
    """Processes left out of `processes` to keep the report within its bounds (the smallest by
    memory); null when none was."""
    omitted_memory_mib: MiB | None = Field(default=None, alias="omittedMemoryMiB")
    """Memory the omitted processes use."""
    error: DeviceError | None = None
    """Set when this GPU could not be read completely (lost, no permission, ...)."""


SOURCE_REASON_SCHEMA: dict[str, Any] = {
    "type": "string",
    "pattern": f"^({'|'.join(get_args(SourceReason))})$",
}
"""A pattern, not an enum: the apiserver checks a null against an enum, and a merge patch
removes the reason with a null once the agent reads the GPUs again."""


class Source(ApiModel):
    """Where the observation came from, and whether the GPU library worked on this node."""

    kind: Literal["nvml", "fake", "none"]
    """nvml: the real driver; fake: a scenario file; none: no NVML on this node."""
    available: bool
    """False when the node has no usable NVML; the report then lists no GPUs."""
    message: Message | None = None
    """Why the library is unavailable, or other notes from the agent."""
    reason: Annotated[SourceReason, WithJsonSchema(SOURCE_REASON_SCHEMA)] | None = None
    """With available false: why the agent reads no GPU on purpose (DriverUpgrade: the GPU
    Operator is replacing the driver, and the agent let go of it); absent when the library
    failed by itself."""
    driver_version: ShortText | None = None
    cuda_version: ShortText | None = None
    nvml_version: ShortText | None = None
    agent_version: ShortText | None = None


MAX_POD_REPLICATED = 8  # devices a pod holds time-slicing replicas of, listed (more: no share)
MAX_KUBELET_REPLICAS = 64  # of those, for all pods; and devices advertised as replicas, listed


class DeviceReplicas(ApiModel):
    """How many time-slicing replicas of one device: the device plugin advertises it as that
    many devices (`<UUID>::<n>`), or a pod was given that many of them."""

    device: KubeletDeviceId
    replicas: Annotated[int, Field(ge=1, le=MAX_COUNTED)]


DraDriverName = Annotated[str, Field(max_length=63, pattern=DNS_SUBDOMAIN_PATTERN)]
DraPoolName = Annotated[str, Field(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9./]*[a-z0-9])?$")]
DraDeviceName = Annotated[str, Field(max_length=63, pattern=DNS_LABEL_PATTERN)]


class KubeletClaimDevice(ApiModel):
    """One device a DRA driver prepared for one of the pod's claims, as the kubelet's
    PodResources API lists it per container (`dynamic_resources`): the kubelet names the claim,
    driver, pool and device, never the device's UUID."""

    claim: PodName
    """The ResourceClaim's name (in the pod's namespace)."""
    driver: DraDriverName
    pool: DraPoolName
    device: DraDeviceName
    uuid: DeviceId | None = None
    """The GPU or MIG UUID, where the CDI devices the driver prepared for it name exactly one
    device of this node (by NVIDIA_VISIBLE_DEVICES or a /dev/nvidia<minor> node); None: not
    known from the node (the operator then maps the device through its ResourceSlice, where it
    may read them)."""


class KubeletPod(ApiModel):
    """The devices the kubelet gave one pod (PodResources List): those its device manager
    handed out for the GPU resources the agent counts, and those DRA drivers prepared."""

    namespace: Namespace
    name: PodName
    resources: Annotated[list[ResourceName], Field(max_length=4)] = Field(default_factory=list)
    """The GPU resources the devices were given for, e.g. nvidia.com/gpu."""
    devices: Annotated[list[KubeletDeviceId], Field(max_length=MAX_KUBELET_DEVICES)] = Field(
        default_factory=list
    )
    """GPU and MIG UUIDs, once each (a time-sliced replica's `::<n>` suffix removed)."""
    other_devices: Annotated[int, Field(ge=0, le=MAX_COUNTED)] = 0
    """Device IDs that are not GPU or MIG UUIDs (a plugin's own names, a resource name longer
    than this list admits): the pod's devices are then not known one by one."""
    replicas: Annotated[list[DeviceReplicas], Field(max_length=MAX_POD_REPLICATED)] = Field(
        default_factory=list
    )
    """The time-slicing replicas the pod was given, by device (IDs with the `::<n>` suffix)."""
    claim_devices: Annotated[list[KubeletClaimDevice], Field(max_length=MAX_POD_CLAIM_DEVICES)] = (
        Field(default_factory=list)
    )
    """The devices DRA drivers prepared for the pod's claims, once each. Empty where the kubelet
    lists none: a kubelet that does not list DRA devices says so in `draMessage`."""
    omitted_claim_devices: Annotated[int, Field(ge=0, le=MAX_COUNTED)] = 0
    """DRA devices of the pod not listed (over the bound): its claims' devices are then not
    known one by one from the node."""


class KubeletAllocations(ApiModel):
    """What the kubelet's PodResources API said this cycle. Absent: the agent does not read it
    (the pod-resources socket is not mounted), and allocations are known as counts only."""

    state: Literal["Read", "Unavailable"]
    message: Message | None = None
    """Why the kubelet could not be read."""
    pods: Annotated[list[KubeletPod], Field(max_length=MAX_KUBELET_PODS)] = Field(
        default_factory=list
    )
    """Pods given GPUs by a device plugin or devices by a DRA driver (of any driver: which are
    GPUs the operator's --dra-drivers says), by namespace and name."""
    omitted_pods: Annotated[int, Field(ge=0, le=MAX_COUNTED)] | None = None
    """Pods with GPUs or DRA devices not listed (over the bound); their devices are not known
    one by one."""
    replicated: Annotated[list[DeviceReplicas], Field(max_length=MAX_KUBELET_REPLICAS)] = Field(
        default_factory=list
    )
    """Devices the device plugins advertise as several time-slicing replicas, and how many
    (GetAllocatableResources): a pod given one of N has a handed share of 1/N."""
    replicas_message: Message | None = None
    """Why the replicas the devices are advertised as could not be read: pods given a replica
    then have no handed share."""
    dra_message: Message | None = None
    """What of the kubelet's view of DRA could not be read: a kubelet that lacks the `Get` call
    or has it turned off (and so, most likely, the DRA devices in List), or CDI spec folders
    not mounted (the devices' UUIDs unknown). Pods' claims are then known from the API alone."""

    @model_validator(mode="after")
    def _devices_bounded(self) -> KubeletAllocations:
        """The same bound as the CRD's rule (see api.crd)."""
        at_most(sum(len(p.devices) for p in self.pods), MAX_KUBELET_DEVICES, "kubelet devices")
        at_most(sum(len(p.replicas) for p in self.pods), MAX_KUBELET_REPLICAS, "kubelet replicas")
        at_most(
            sum(len(p.claim_devices) for p in self.pods),
            MAX_KUBELET_CLAIM_DEVICES,
            "kubelet claim devices",
        )
        return self


class GpuNodeUsageSpec(ApiModel):
    """What the node agent observed on its node. Written by the agent only."""

    node_name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
    """The node this report describes; equals metadata.name."""
    observed_at: datetime
    """When the observation was taken (RFC 3339)."""
    source: Source | None = None
    gpus: Annotated[list[Gpu], Field(max_length=MAX_GPUS)] = Field(default_factory=list)
    kubelet: KubeletAllocations | None = None

    @model_validator(mode="after")
    def _processes_bounded(self) -> GpuNodeUsageSpec:
        """The same bound as the CRD's rule on the whole node (see api.crd)."""
        listed = sum(
            len(g.processes) + sum(len(m.processes) for m in g.mig_devices) for g in self.gpus
        )
        at_most(listed, MAX_PROCESSES, "processes")
        return self


class Condition(ApiModel):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: Annotated[str, Field(pattern=CONDITION_TYPE_PATTERN, max_length=316)]
    status: Literal["True", "False", "Unknown"]
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    last_transition_time: datetime
    reason: Annotated[str, Field(pattern=CONDITION_REASON_PATTERN, min_length=1, max_length=128)]
    """At most 128 characters (metav1.Condition allows 1024; the operator's are short names)."""
    message: Annotated[str, Field(max_length=MAX_MESSAGE)] = ""
    """At most 1024 characters (metav1.Condition allows 32768): the object must stay small."""


class ContainerUsage(ApiModel):
    """GPU use of one container of a pod on one device. Its container ID is not restated here:
    the report's processes carry it beside these pids."""

    name: Annotated[str, Field(max_length=63, pattern=DNS_LABEL_PATTERN)] | None = None
    """Container name; null when the process matched the pod by UID only."""
    pids: Annotated[
        list[Annotated[int, Field(ge=1, le=MAX_PID)]], Field(max_length=MAX_PIDS_LISTED)
    ] = Field(default_factory=list)
    """The container's processes on the device (the lowest pids, when there are more)."""
    used_memory_mib: MiB = Field(default=0, alias="usedMemoryMiB")


class PodUsage(ApiModel):
    """One pod's use of one GPU or MIG device.

    One entry per (pod, device) in a flat list, so that tools which cannot walk nested lists
    (kube-state-metrics' custom-resource metrics) get one series per pod and device.
    """

    namespace: Namespace
    name: PodName
    uid: Annotated[str, Field(pattern=POD_UID_PATTERN)]
    device_uuid: DeviceId = Field(alias="deviceUUID")
    """GPU or MIG device UUID."""
    containers: Annotated[list[ContainerUsage], Field(max_length=64)] = Field(default_factory=list)
    used_memory_mib: MiB = Field(default=0, alias="usedMemoryMiB")
    """Memory the pod's processes use on this device."""
    requested_gpus: RequestedGpus = Field(default=0, alias="requestedGPUs")
    """GPUs the pod requested (nvidia.com/gpu and MIG resources in its containers' limits)."""
    unrequested: bool = False
    """True when the pod uses a GPU although it has no allocation of any kind (e.g. through
    NVIDIA_VISIBLE_DEVICES=all): invisible to the scheduler and to quota."""
    allocated_by: Annotated[list[AllocationSource], Field(max_length=3)] = Field(
        default_factory=list
    )
    """How the cluster handed the pod GPUs: DevicePlugin (a count), DRA (claims), Fractional
    (a scheduler's share in its annotations); empty: none."""
    allocated_devices: Annotated[list[AllocatedDeviceId], Field(max_length=MAX_ALLOCATED)] = Field(
        default_factory=list
    )
    """The devices its allocation names where they can be known (DRA claims, the kubelet's
    device IDs): GPU or MIG UUIDs, or `<parent GPU UUID>/<profile>` for a MIG device created at
    prepare time (no UUID yet). Listed while the status's budget lasts (see
    allocatedDevicesOmitted)."""
    allocated_devices_omitted: Annotated[int, Field(ge=0, le=MAX_DEVICES)] | None = None
    """Allocated devices not listed here: the status lists at most 256 in all."""
    unallocated: bool = False
    """True when the pod has a device-level allocation and this device is outside it."""
    out_of_scope: bool = False
    """True when the pod's namespace is outside the operator's --namespace-selector: counted
    here, but the operator writes nothing on the pod (no marks, no Events, no policy)."""
    held_idle_since: datetime | None = None
    """Set when every process of the pod, on every device, has computed nothing for the
    operator's --idle-after while holding memory: since when, by the operator's clock."""
    computing: bool | None = None
    """Whether the pod computes on this device: true when one of its processes here used an
    engine (SMs, memory controller, encoder, decoder) within the agent's --idle-window, false
    when all have been quiet for it; absent where the device does not say (MIG devices, MPS
    clients, some GPUs) or the agent predates this field. The bill of use counts GPU-hours
    computing from it."""
    compute_share: Share | None = None
    """The pod's share of this device's time over the agent's --share-window: the sum of its
    processes' computeShare here; absent when none of them has one (see Process)."""
    handed_share: Share | None = None
    """The share of this device's time the pod was handed, beside computeShare: the part of a
    device several claims share that its DRA claim consumed (a `shares` or `cores` capacity
    over the device's: NVIDIA's consumable shares, HAMi's cores), a DRA claim's that shares it
    among the running pods naming it (NVIDIA's GpuConfig sharing: MPS's default active thread
    percentage, else an equal part each, for MPS and time-slicing), one of the device plugin's
    time-slicing replicas, or a fractional scheduler's gpu-fraction (KAI, Run:ai). Absent
    where it was handed none (a whole GPU, no allocation). Time-slicing promises no fairness:
    using more is no misuse."""
    handed_memory_mib: MiB | None = Field(default=None, alias="handedMemoryMiB")
    """The GPU memory of this device the pod was handed, beside usedMemoryMiB: the memory
    capacity its DRA claim consumed of a device several claims share (NVIDIA's consumable
    shares in memory mode, HAMi's memory), an equal part for each running pod naming the claim.
    Absent where the device's memory is not parted out (a whole GPU, a claim that consumed
    none)."""


class DeviceUsage(ApiModel):
    """One GPU or MIG device: its memory, its processes, and how much of it no pod explains.

    Every device of the report is listed, MIG devices beside their GPU, so that per-device
    alerts (memory nearly full, memory held outside any pod) see MIG slices too.
    """

    uuid: DeviceId
    """GPU or MIG device UUID."""
    index: Annotated[int, Field(ge=0, le=MAX_GPUS)] | None = None
    """NVML index of the GPU (of the parent GPU for a MIG device)."""
    parent_uuid: DeviceId | None = Field(default=None, alias="parentUUID")
    """For a MIG device: the UUID of its GPU."""
    total_memory_mib: MiB | None = Field(default=None, alias="totalMemoryMiB")
    used_memory_mib: MiB | None = Field(default=None, alias="usedMemoryMiB")
    """Memory in use on the device as NVML counts it (processes, driver and contexts)."""
    processes: Annotated[int, Field(ge=0, le=MAX_PROCESSES)] = 0
    """Processes the report lists on this device."""
    pods: Annotated[int, Field(ge=0, le=MAX_PROCESSES)] = 0
    unattributed_processes: Annotated[int, Field(ge=0, le=MAX_PROCESSES)] = 0
    """Processes on this device that belong to no known pod."""
    unattributed_memory_mib: MiB = Field(default=0, alias="unattributedMemoryMiB")
    """Memory those processes hold."""
    omitted_processes: Annotated[int, Field(ge=0)] | None = None
    """Processes the agent left out of its report for this device (the smallest by memory, when
    the node runs more than a report may list)."""
    omitted_memory_mib: MiB | None = Field(default=None, alias="omittedMemoryMiB")
    """Memory the omitted processes use."""
    blind: BlindReason | None = None
    """Why the report cannot show everything on this device, so that a pod last seen on it is
    Unknown rather than ended, and not judged idle: DeviceNotReadable (an NVML error, a process
    list that cannot be true), ProcessesNotVisible (memory in use that the listed processes do
    not hold: NVML does not list them all), ProcessesUnresolved (a process the agent could not
    attribute), ProcessesOmitted (left out of a full report), DriverUpgrade (the agent let go of
the driver while the GPU Operator replaces it). Absent: everything is seen."""


class IdlePod(ApiModel):
    """A running pod that was given GPUs on this node (a device-plugin request, DRA claims, a
    scheduler's share) and has used none of them for a while."""

    namespace: Namespace
    name: PodName
    uid: Annotated[str, Field(pattern=POD_UID_PATTERN)]
    requested_gpus: RequestedGpus = Field(default=0, alias="requestedGPUs")
    """GPUs it holds: its device-plugin request plus the devices its claims got (0 for a
    scheduler's share alone)."""
    idle_since: datetime
    """Since when none of the pod's processes has used a GPU (its start, or the end of its last
    use)."""


class PodAllocation(ApiModel):
    """What one running pod on this node was handed, counted as what it is: whole GPUs, MIG
    slices, a scheduler's share. Whether or not it uses them (showback of what is held)."""

    namespace: Namespace
    name: PodName
    uid: Annotated[str, Field(pattern=POD_UID_PATTERN)]
    gpus: RequestedGpus = 0
    """Whole GPUs: device-plugin GPU resources other than MIG (nvidia.com/gpu and any
    --gpu-resources), and the whole GPUs its DRA claims got (its extended-resource claim's
    too: a GPU resource a DRA driver serves is counted once, as the claim's devices)."""
    mig_devices: RequestedGpus = Field(default=0, alias="migDevices")
    """MIG slices: nvidia.com/mig-* resources, and the MIG devices its claims got."""
    gpu_share: Annotated[float, Field(gt=0, le=MAX_SHARE)] | None = None
    """Shares of GPUs, added up: a fractional scheduler's (its gpu-fraction annotation), the
    device plugin's time-slicing replicas whose count is known, and the part of devices several
    DRA claims share that its claims consumed (handedShare)."""
    gpu_memory_share_mib: Annotated[int, Field(gt=0, le=MAX_MIB)] | None = Field(
        default=None, alias="gpuMemoryShareMiB"
    )
    """GPU memory handed as a share, in MiB: a fractional scheduler's (its gpu-memory
    annotation) and what its DRA claims consumed of shared devices (handedMemoryMiB)."""


class UnattributedProcess(ApiModel):
    """A process on a GPU that belongs to no known pod, with the reason."""

    pid: Annotated[int, Field(ge=1, le=MAX_PID)]
    name: ProcessName | None = None
    device_uuid: DeviceId = Field(alias="deviceUUID")
    used_memory_mib: MiB | None = Field(default=None, alias="usedMemoryMiB")
    reason: UnattributedReason
    message: Detail = ""


class Totals(ApiModel):
    """Sums over the node, shown by `kubectl get gpunodeusage`."""

    gpus: Annotated[int, Field(ge=0)] = 0
    pods: Annotated[int, Field(ge=0)] = 0
    processes: Annotated[int, Field(ge=0)] = 0
    used_memory_mib: MiB = Field(default=0, alias="usedMemoryMiB")
    """Memory used by all GPU processes on the node."""
    total_memory_mib: MiB = Field(default=0, alias="totalMemoryMiB")
    unattributed_processes: Annotated[int, Field(ge=0)] = 0
    unattributed_memory_mib: MiB = Field(default=0, alias="unattributedMemoryMiB")
    """Memory held by processes that belong to no known pod."""
    unrequested_pods: Annotated[int, Field(ge=0)] = 0
    """Pods using a GPU without having requested one."""
    unallocated_pods: Annotated[int, Field(ge=0)] = 0
    """Pods using a device outside their allocation."""
    held_idle_pods: Annotated[int, Field(ge=0)] = 0
    """Pods holding GPU memory whose processes have computed nothing for --idle-after."""
    idle_pods: Annotated[int, Field(ge=0)] = 0
    """Running pods that requested GPUs and used none for the operator's --idle-after."""
    blind_devices: Annotated[int, Field(ge=0, le=MAX_DEVICES)] = 0
    """Devices the report cannot show whole (see devices[].blind)."""
    memory: ShortText = ""
    """used/total in a form people read, e.g. "30720Mi/163840Mi"."""


class OrphanedMemory(ApiModel):
    """GPU memory held by processes of no live pod: of pods that are gone (PodNotFound), of
    containers no pod has (UnknownContainer), of no container (HostProcess). NVIDIA's daemons
    and processes the agent could not attribute are not counted: neither is known to be of no
    pod."""

    memory_mib: MiB = Field(default=0, alias="memoryMiB")
    processes: Annotated[int, Field(ge=0, le=MAX_COUNTED)] = 0
    since: datetime | None = None
    """Since when the node has held such memory without a break (by the operator's clock)."""


class GpuNodeUsageStatus(ApiModel):
    """The operator's interpretation of the report. Written by the operator only."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    report_seen_at: datetime | None = None
    """When the operator first saw the report's observedGeneration, by its own clock. Freshness
    (the Stale condition) is judged from this, never from spec.observedAt, which the node's
    clock wrote."""
    conditions: Annotated[list[Condition], Field(max_length=MAX_CONDITIONS)] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    totals: Totals | None = None
    orphaned: OrphanedMemory | None = None
    """GPU memory held by processes of no live pod (absent: none); what the OrphanedGPUMemory
    node rule of a policy acts upon."""
    devices: Annotated[list[DeviceUsage], Field(max_length=MAX_DEVICES)] = Field(
        default_factory=list
    )
    pods: Annotated[list[PodUsage], Field(max_length=MAX_POD_DEVICES)] = Field(default_factory=list)
    """Pods resolved from the processes, one entry per pod and device."""
    unattributed: Annotated[list[UnattributedProcess], Field(max_length=MAX_UNATTRIBUTED)] = Field(
        default_factory=list
    )
    idle_pods: Annotated[list[IdlePod], Field(max_length=MAX_IDLE_PODS)] = Field(
        default_factory=list
    )
    """Running pods that were given GPUs on this node and used none for the operator's
    --idle-after (only judged while the report is fresh and every device could be read)."""
    allocations: Annotated[list[PodAllocation], Field(max_length=MAX_ALLOCATIONS)] = Field(
        default_factory=list
    )
    """Every running pod on this node that was handed GPUs, with what it was handed, in use or
    not (from the pods and their claims, so also while the report is stale)."""
    allocations_omitted: Annotated[int, Field(ge=0, le=MAX_COUNTED)] | None = None
    """Such pods not listed (over the bound)."""

    @model_validator(mode="after")
    def _allocated_bounded(self) -> GpuNodeUsageStatus:
        """The same bound as the CRD's rule (see api.crd)."""
        listed = sum(len(p.allocated_devices) for p in self.pods)
        at_most(listed, MAX_ALLOCATED_LISTED, "allocated devices")
        return self

    @property
    def stale(self) -> bool:
        """Whether the Stale condition is True: the node's report is outdated."""
        return any(c.type == names.CONDITION_STALE and c.status == "True" for c in self.conditions)


class ObjectMeta(ApiModel):
    """The parts of metadata the project reads and writes."""

    name: str
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    owner_references: list[dict[str, Any]] = Field(default_factory=list)


class GpuNodeUsage(ApiModel):
    """GPU use on one node: the agent's observation (spec) and the operator's view (status)."""

    api_version: Literal["gpuusage.io/v1alpha1"] = "gpuusage.io/v1alpha1"
    kind: Literal["GpuNodeUsage"] = "GpuNodeUsage"
    metadata: ObjectMeta
    spec: GpuNodeUsageSpec
    status: GpuNodeUsageStatus | None = None
