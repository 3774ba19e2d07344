"""What a report cannot tell. Pure.

A pod's GPU use ends when the report shows none of its processes. That conclusion holds only
where the report could see: "could not read" is not "exited". A report is blind

* everywhere, when the node has no usable GPU library (NVML unavailable), or its agent let
  go of the driver while the GPU Operator replaces it (spec.source.reason DriverUpgrade: the
  pods' use is then Unknown with that reason, never ended);
* on a device with an error (lost GPU, no permission, a process list that cannot be true), and
  on the MIG devices of such a GPU;
* on a device whose memory in use the listed processes do not hold (the agent says so with the
  error ProcessesNotVisible: NVML does not list every process, as with pids outside the agent's
  pid namespace or MIG without the monitor capability);
* on a device that is no longer reported at all;
* on a device with processes the agent could not attribute to any container (its /proc files
  unreadable, hidden or unparseable): one of them may be the pod's;
* on a device whose processes the agent did not all list (more than a report may hold).

A pod the operator last knew to use GPUs, whose processes this report does not show, is then
`Unknown` when the report is blind on a device the pod was using, with the reason and a
message the operator composes (what the agent wrote about the device or process stays in the
report and never reaches the pod's tenant); only a report that could see all of them says its
use ended. A pod already marked as not using GPUs
stays so: nothing in a blind spot says it started. Idle detection asks the same question, pod
by pod: only a report that sees every device a pod could be using can show that it uses none
(see sees_all): one blind device never switches judgement off for the whole node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuusage.api import names
from gpuusage.api.models import (
    MAX_PROCESSES,
    DeviceError,
    Gpu,
    GpuNodeUsageSpec,
    MigDevice,
)
from gpuusage.api.reasons import BlindReason
from gpuusage.api.summary import device_uuid
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.allocation import Allocation
from gpuusage_operator.judge.resolution import Resolution
from gpuusage_operator.judge.restarts import in_use

REASON_DEVICE: BlindReason = "DeviceNotReadable"
REASON_UNRESOLVED: BlindReason = "ProcessesUnresolved"
REASON_OMITTED: BlindReason = "ProcessesOmitted"
REASON_NOT_VISIBLE: BlindReason = "ProcessesNotVisible"
REASON_UPGRADE: BlindReason = "DriverUpgrade"


@dataclass(frozen=True)
class Cause:
    """Why the use of a pod is unknown: a pod condition reason (also the status's name for a
    blind device) and a sentence."""

    reason: BlindReason
    message: str


@dataclass(frozen=True)
class BlindSpots:
    """Where one report cannot see."""

    everywhere: Cause | None = None
    devices: dict[str, Cause] = field(default_factory=dict)
    reported: frozenset[str] = frozenset()
    """Every device UUID the report lists."""

    def __bool__(self) -> bool:
        return self.everywhere is not None or bool(self.devices)

    def on(self, uuid: str) -> Cause | None:
        """Why the report cannot see device `uuid`, if it cannot."""
        if self.everywhere is not None:
            return self.everywhere
        if uuid not in self.reported:
            return Cause(REASON_DEVICE, f"device {uuid} is no longer reported by the node agent")
        return self.devices.get(uuid)


def blind_spots(spec: GpuNodeUsageSpec, resolutions: Iterable[Resolution]) -> BlindSpots:
    """Where the report `spec`, resolved to `resolutions`, cannot see."""
    node = spec.node_name
    if spec.source is not None and not spec.source.available:
        if spec.source.reason == REASON_UPGRADE:
            return BlindSpots(
                Cause(
                    REASON_UPGRADE,
                    f"the GPU driver of node {node} is being upgraded: its node agent holds no "
                    "GPU until the new driver is loaded",
                )
            )
        return BlindSpots(
            Cause(
                REASON_DEVICE,
                f"node {node} cannot read its GPUs (its report's spec.source says why)",
            )
        )
    devices: dict[str, Cause] = {}
    reported: set[str] = set()
    for gpu in spec.gpus:
        parent = device_uuid(gpu)
        # A MIG device of a GPU that could not be read could not be read either.
        listed: list[tuple[str, Gpu | MigDevice, DeviceError | None]] = [(parent, gpu, None)]
        listed += [(m.uuid, m, gpu.error) for m in gpu.mig_devices]
        for uuid, device, inherited in listed:
            reported.add(uuid)
            error = device.error or inherited
            if device.error is not None and device.error.reason == REASON_NOT_VISIBLE:
                devices[uuid] = Cause(
                    REASON_NOT_VISIBLE,
                    f"device {uuid} on node {node} holds memory that the processes the driver "
                    "lists do not hold (processes the node agent cannot see)",
                )
            elif error is not None:
                devices[uuid] = Cause(
                    REASON_DEVICE,
                    f"device {uuid} on node {node} could not be read (its report's "
                    "spec.gpus[].error says why)",
                )
            elif device.omitted_processes:
                devices[uuid] = Cause(
                    REASON_OMITTED,
                    f"{device.omitted_processes} processes on device {uuid} of node {node} were "
                    f"left out of its report (it lists at most {MAX_PROCESSES})",
                )
    for r in resolutions:
        if r.reason == "Unresolved" and r.device_uuid not in devices:
            devices[r.device_uuid] = Cause(
                REASON_UNRESOLVED,
                f"process {r.process.pid} on device {r.device_uuid} of node {node} could not be "
                "attributed to a pod (its report's status.unattributed says why)",
            )
    return BlindSpots(None, devices, frozenset(reported))


def sees_all(blind: BlindSpots, devices: Iterable[str] | None) -> bool:
    """Whether the report sees every one of `devices` (None: which devices is not known, so
    every device of the node counts)."""
    if blind.everywhere is not None:
        return False
    if devices is None:
        return not blind.devices
    return all(blind.on(uuid) is None for uuid in devices)


def devices_of(
    allocation: Allocation,
    used: Iterable[str],
    pod: PodSnapshot,
    spec: GpuNodeUsageSpec,
    last: LastDevices | None = None,
) -> list[str] | None:
    """The devices a pod could be using, for sees_all: what it uses, what it was last seen
    on, and its allocated devices with the MIG devices of an allocated GPU (a MIG device made
    at prepare time: every MIG device of its parent). None when its allocation is not known
    device by device: it could then be on any device of the node."""
    if not allocation.complete:
        return None
    children: dict[str, list[str]] = {
        g.uuid: [m.uuid for m in g.mig_devices] for g in spec.gpus if g.uuid
    }
    found = [*used, *((last or last_devices)(pod) or [])]
    for given in allocation.devices:
        parent = given.uuid or given.parent_uuid or ""
        found += [parent, *children.get(parent, [])]
    return found


def last_devices(pod: PodSnapshot) -> list[str] | None:
    """The devices the pod's annotation last named; None when it names none."""
    return devices_named(pod.our_annotations.get(names.ANNOTATION_GPUS))


def devices_named(listed: str | None) -> list[str] | None:
    """The devices of a `gpuusage.io/gpus` value; None for none."""
    devices = [d for d in (listed or "").split(",") if d]
    return devices or None


LastDevices = Callable[[PodSnapshot], list[str] | None]
"""Where a pod was last seen using GPUs. The pod's annotation is only the pod's word: anyone
who may edit the pod can write it, and a device named there that the node does not report makes
the pod's use Unknown (see why_unknown) and withholds idle judgement. The operator passes what
it judged itself (see last_seen)."""


def last_seen(pod: PodSnapshot, seen_on: Mapping[str, tuple[str, ...]]) -> list[str] | None:
    """Where the pod was last seen using GPUs: where this replica last judged it in use (an
    empty entry: its use ended, seen nowhere); for a pod it has not judged (after a restart or
    a failover), the pod's annotation, but only while our condition says it is or may be in use
    (a condition tenants cannot write: pods/status). An annotation planted on a pod never seen
    in use, or over what we judged, naming a device the node does not report, would otherwise
    make its use Unknown for good and keep it from ever being judged idle."""
    devices = seen_on.get(pod.uid)
    if devices is not None:
        return list(devices) or None
    return last_devices(pod) if in_use(pod) else None


def why_unknown(
    pod: PodSnapshot, blind: BlindSpots, last: LastDevices | None = None
) -> Cause | None:
    """Why this report cannot say that the pod's GPU use ended, or None when it can.

    Asked of pods with our marks whose processes the report does not show.
    """
    condition = pod.our_condition
    if condition is None or condition.get("status") == "False":
        return None  # not known to be using GPUs
    devices = (last or last_devices)(pod)
    if devices is None:  # in use, but on which device is not known: any blind spot counts
        return blind.everywhere or next(iter(blind.devices.values()), None)
    for uuid in devices:
        cause = blind.on(uuid)
        if cause is not None:
            return cause
    return None
