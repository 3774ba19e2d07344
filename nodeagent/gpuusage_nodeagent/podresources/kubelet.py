"""What the kubelet's device manager gave each pod, as the agent publishes it.

`allocations` (pure) turns the kubelet's answer into the report's `kubelet` section; `Kubelet`
asks the socket, and turns every way the question can fail into an `Unavailable` section with
the reason, so the operator then knows allocations as counts only and judges nothing by device.

Device plugins name devices in their own ways. NVIDIA's plugin gives UUIDs by default; with
`deviceIDStrategy=index` it gives NVML indexes (`0`, and `0:1` for MIG device 1 of GPU 0), and
GKE's plugin names device nodes (`nvidia0`, the minor number). Those are mapped to UUIDs
through the GPUs the agent read (`device_aliases`); an ID that maps to nothing stays counted,
never guessed.

A device a device plugin shares by time-slicing (NVIDIA's `sharing.timeSlicing` or `mps`
replicas) is advertised as N devices `<UUID>::<n>`: the kubelet's GetAllocatableResources lists
them all, so the report says how many replicas each such device has (`replicated`) and how many
each pod was given (`replicas`), from which the operator tells the share each pod was handed.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path

from pydantic import ValidationError

from gpuusage.api.models import (
    KUBELET_DEVICE_PATTERN,
    MAX_COUNTED,
    MAX_KUBELET_DEVICES,
    MAX_KUBELET_PODS,
    MAX_KUBELET_REPLICAS,
    MAX_MESSAGE,
    MAX_POD_REPLICATED,
    MAX_RESOURCE_NAME,
    RESOURCE_NAME_PATTERN,
    DeviceReplicas,
    Gpu,
    KubeletAllocations,
    KubeletPod,
    safe_text,
)
from gpuusage.api.resources import REPLICA_SEPARATOR, device_of, is_gpu_resource
from gpuusage_nodeagent.podresources.client import CallError, unary
from gpuusage_nodeagent.podresources.wire import (
    ContainerDevices,
    PodResources,
    WireError,
    allocatable_response,
    list_response,
)

log = logging.getLogger(__name__)

LIST = "/v1.PodResourcesLister/List"
ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"
_DEVICE = re.compile(KUBELET_DEVICE_PATTERN)
_RESOURCE = re.compile(RESOURCE_NAME_PATTERN)
MAX_RESOURCES = 4


Aliases = Mapping[str, str]
"""A device plugin's non-UUID device ID → the GPU or MIG UUID it names."""


def device_aliases(gpus: Iterable[Gpu]) -> dict[str, str]:
    """The IDs other device plugins use for the agent's GPUs: NVML index (`3`), index of a
    MIG device on its GPU (`3:1`), device node (`nvidia<minor>`)."""
    found: dict[str, str] = {}
    for gpu in gpus:
        if gpu.uuid is None:
            continue
        found[str(gpu.index)] = gpu.uuid
        if gpu.minor_number is not None:
            found[f"nvidia{gpu.minor_number}"] = gpu.uuid
        for mig in gpu.mig_devices:
            found[f"{gpu.index}:{mig.index}"] = mig.uuid
    return found


def _device(device_id: str, aliases: Aliases) -> str | None:
    """The GPU or MIG UUID a device plugin's ID names (a replica's, its device's); None for
    an ID that names none."""
    device = device_of(device_id)
    device = aliases.get(device, device)
    return device if _DEVICE.match(device) else None


def _replicas(counts: Mapping[str, int]) -> list[DeviceReplicas]:
    return [
        DeviceReplicas(device=d, replicas=min(n, MAX_COUNTED)) for d, n in sorted(counts.items())
    ]


def replicated(
    advertised: Iterable[ContainerDevices],
    extra: Iterable[str] = (),
    aliases: Aliases | None = None,
) -> list[DeviceReplicas]:
    """The devices the device plugins advertise as time-slicing replicas (`<UUID>::<n>`, for a
    GPU resource), with how many: what a pod given one of them was handed is 1/N."""
    extra = tuple(extra)
    ids: dict[str, set[str]] = {}
    for given in advertised:
        if not is_gpu_resource(given.resource_name, extra):
            continue
        for device_id in given.device_ids:
            device = _device(device_id, aliases or {})
            if device is not None and REPLICA_SEPARATOR in device_id:
                ids.setdefault(device, set()).add(device_id)
    several = {device: len(n) for device, n in ids.items() if len(n) > 1}  # one: the device
    return _replicas(several)[:MAX_KUBELET_REPLICAS]


def _entry(pod: PodResources, extra: Iterable[str], aliases: Aliases) -> KubeletPod | None:
    """The pod's GPU devices; None when it was given none (or names nothing valid)."""
    resources: set[str] = set()
    devices: set[str] = set()
    replicas: dict[str, set[str]] = {}
    other = 0
    for container in pod.containers:
        for given in container.devices:
            if not is_gpu_resource(given.resource_name, extra):
                continue
            named = (
                bool(_RESOURCE.match(given.resource_name))
                and len(given.resource_name) <= MAX_RESOURCE_NAME
            )
            if named:
                resources.add(given.resource_name)
            for device_id in given.device_ids:
                device = _device(device_id, aliases)
                if named and device is not None:
                    devices.add(device)
                    if REPLICA_SEPARATOR in device_id:  # an ID listed twice is one replica
                        replicas.setdefault(device, set()).add(device_id)
                else:
                    other += 1
    if not (resources or other):
        return None
    if len(resources) > MAX_RESOURCES:
        other += len(devices)
        devices.clear()
        replicas.clear()
    try:
        return KubeletPod(
            namespace=pod.namespace,
            name=pod.name,
            resources=sorted(resources)[:MAX_RESOURCES],
            devices=sorted(devices),
            other_devices=min(other, MAX_COUNTED),
            replicas=_replicas({d: len(ids) for d, ids in replicas.items()})[:MAX_POD_REPLICATED],
        )
    except ValidationError:
        return None  # not a pod name the API admits: it cannot be matched to a pod anyway


def allocations(
    pods: Sequence[PodResources],
    extra: Iterable[str] = (),
    aliases: Aliases | None = None,
    advertised: Sequence[ContainerDevices] | None = None,
    replicas_unknown: str | None = None,
) -> KubeletAllocations:
    """The report's `kubelet` section: pods given GPU resources, in name order, within the
    bounds (pods past them are counted as omitted, never listed in part); `aliases` map other
    plugins' device IDs to UUIDs (see device_aliases); `advertised`, the devices the plugins
    advertise (GetAllocatableResources), tell the devices shared as replicas, or
    `replicas_unknown` why they could not be read."""
    extra = tuple(extra)
    known = aliases or {}
    entries = sorted(
        (e for e in (_entry(p, extra, known) for p in pods) if e is not None),
        key=lambda e: (e.namespace, e.name),
    )
    listed: list[KubeletPod] = []
    devices = replicas = 0
    for entry in entries:
        if len(listed) == MAX_KUBELET_PODS or devices + len(entry.devices) > MAX_KUBELET_DEVICES:
            break
        if replicas + len(entry.replicas) > MAX_KUBELET_REPLICAS:  # its shares untold, not wrong
            listed.append(entry.model_copy(update={"replicas": []}))
        else:
            listed.append(entry)
            replicas += len(entry.replicas)
        devices += len(entry.devices)
    omitted = len(entries) - len(listed)
    why = None
    if replicas_unknown is not None:
        why = safe_text(f"GetAllocatableResources: {replicas_unknown}", MAX_MESSAGE)
    return KubeletAllocations(
        state="Read",
        pods=listed,
        omitted_pods=min(omitted, MAX_COUNTED) or None,
        replicated=replicated(advertised or (), extra, known),
        replicas_message=why,
    )


def unavailable(why: str) -> KubeletAllocations:
    return KubeletAllocations(
        state="Unavailable", message=safe_text(f"kubelet PodResources: {why}", MAX_MESSAGE)
    )


Lister = Callable[[Path, float], bytes]


def list_pods(path: Path, timeout: float) -> bytes:
    return unary(path, LIST, b"", timeout)


def list_allocatable(path: Path, timeout: float) -> bytes:
    return unary(path, ALLOCATABLE, b"", timeout)


class Kubelet:
    """Asks the kubelet's pod-resources socket when its answer may have changed.

    A pod's devices are fixed for its life, so the answer matters anew only when a pod the
    agent has not seen yet uses a GPU (asked in that very cycle, after its processes were
    read), after a failure (asked every cycle until it works), and otherwise every `refresh`
    seconds (pods that left). Asking every cycle would cost about a quarter of a cycle's CPU
    (benchmarks/README.md).

    Disabled (`read` gives None) when the socket's folder is not there: the DaemonSet does not
    mount it, which is a choice, not a fault. A missing socket inside a mounted folder (the
    kubelet restarting) is a fault, said in the section.
    """

    def __init__(
        self,
        socket: Path,
        timeout: float,
        extra_resources: Iterable[str] = (),
        *,
        refresh: float = 60.0,
        lister: Lister = list_pods,
        allocatable: Lister = list_allocatable,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket = socket
        self.timeout = timeout
        self.extra = tuple(extra_resources)
        self.refresh = refresh
        self.lister = lister
        self.allocatable = allocatable
        self.clock = clock
        self.enabled = socket.parent.is_dir()
        self.asked = 0
        """Times the kubelet was asked."""
        self._last: KubeletAllocations | None = None
        self._raw: Sequence[PodResources] | None = None
        """The kubelet's last answer, kept to translate again when the aliases change."""
        self._advertised: Sequence[ContainerDevices] | None = None
        self._replicas_unknown: str | None = None
        self._aliases: Aliases = {}
        self._asked_at = 0.0
        self._known_pods: frozenset[str] = frozenset()
        self._last_failure: str | None = None
        if not self.enabled:
            log.info("%s is not mounted: allocations are known as counts only", socket.parent)

    def read(
        self, pods: Collection[str] = (), aliases: Aliases | None = None
    ) -> KubeletAllocations | None:
        """The allocations for a cycle whose processes belong to `pods` (UIDs), other plugins'
        device IDs mapped through `aliases` (see device_aliases)."""
        if not self.enabled:
            return None
        now = self.clock()
        aliases = aliases or {}
        if (
            self._last is not None
            and self._last.state == "Read"
            and self._known_pods.issuperset(pods)
            and now - self._asked_at < self.refresh
        ):
            if aliases != self._aliases and self._raw is not None:
                self._aliases = dict(aliases)
                self._last = self._translate(self._raw)
            return self._last
        self.asked += 1
        self._asked_at = now
        self._known_pods = frozenset(pods)
        self._aliases = dict(aliases)
        self._last = self._ask()
        return self._last

    def _ask(self) -> KubeletAllocations:
        try:
            self._raw = list_response(self.lister(self.socket, self.timeout))
            self._ask_allocatable()
            found = self._translate(self._raw)
        except FileNotFoundError:
            return self._failed(
                f"{self.socket} not found (is the kubelet running? a kubelet with another "
                "--root-dir, as k0s and MicroK8s have, keeps it in <root-dir>/pod-resources: "
                "mount that folder there, agent.podResources.hostPath)"
            )
        except PermissionError:
            return self._failed(
                f"{self.socket}: permission denied (the socket is root's: run the agent as "
                "root, as manifests/kubelet-devices does)"
            )
        except OSError as exc:
            return self._failed(f"{self.socket}: {exc.strerror or exc}")
        except CallError as exc:
            return self._failed(str(exc))
        except WireError as exc:
            return self._failed(f"the answer is not a ListPodResourcesResponse ({exc})")
        self._last_failure = None
        return found

    def _ask_allocatable(self) -> None:
        """The devices the plugins advertise, for the replicas; a failure here leaves the
        pods' devices known and only their handed shares unknown, with the reason."""
        try:
            self._advertised = allocatable_response(self.allocatable(self.socket, self.timeout))
            self._replicas_unknown = None
        except (OSError, CallError, WireError) as exc:
            self._advertised = None
            why = str(exc) if not isinstance(exc, OSError) else exc.strerror or str(exc)
            if why != self._replicas_unknown:
                log.warning("reading the kubelet's allocatable devices failed: %s", why)
            self._replicas_unknown = why

    def _translate(self, raw: Sequence[PodResources]) -> KubeletAllocations:
        return allocations(raw, self.extra, self._aliases, self._advertised, self._replicas_unknown)

    def _failed(self, why: str) -> KubeletAllocations:
        if why != self._last_failure:  # a lasting failure is logged once
            self._last_failure = why
            log.warning("reading the kubelet's pod resources failed: %s", why)
        return unavailable(why)
