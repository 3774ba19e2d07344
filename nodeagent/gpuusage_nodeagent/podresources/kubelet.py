"""What the kubelet gave each pod (its device manager, DRA drivers), as the agent publishes it.

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

DRA devices: the kubelet lists, per container, the devices DRA drivers prepared for its claims
(driver, pool, device and the CDI devices handed to the runtime), of every driver; they are
published per pod beside the device-plugin ones, each with its UUID where the CDI specs on the
node name exactly one GPU or MIG device of it (`cdi`). A kubelet that lists no DRA devices
cannot be told by its List answer from one with no DRA pods, so a List without any is followed
by a `Get`, which came with the DRA listing (both alpha in 1.27, beta in 1.34, GA in 1.36): a
kubelet without it says so in `draMessage`.
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
    MAX_KUBELET_CLAIM_DEVICES,
    MAX_KUBELET_DEVICES,
    MAX_KUBELET_PODS,
    MAX_KUBELET_REPLICAS,
    MAX_MESSAGE,
    MAX_POD_CLAIM_DEVICES,
    MAX_POD_REPLICATED,
    MAX_RESOURCE_NAME,
    RESOURCE_NAME_PATTERN,
    DeviceReplicas,
    Gpu,
    KubeletAllocations,
    KubeletClaimDevice,
    KubeletPod,
    safe_text,
)
from gpuusage.api.resources import REPLICA_SEPARATOR, device_of, is_gpu_resource
from gpuusage_nodeagent.podresources.cdi import Edits, NodeGpus, SpecDirs, resolve
from gpuusage_nodeagent.podresources.client import CallError, unary
from gpuusage_nodeagent.podresources.wire import (
    ClaimResource,
    ContainerDevices,
    PodResources,
    WireError,
    allocatable_response,
    get_request,
    get_response,
    list_response,
)

log = logging.getLogger(__name__)

LIST = "/v1.PodResourcesLister/List"
ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"
GET = "/v1.PodResourcesLister/Get"
_DEVICE = re.compile(KUBELET_DEVICE_PATTERN)
_RESOURCE = re.compile(RESOURCE_NAME_PATTERN)
MAX_RESOURCES = 4


Aliases = Mapping[str, str]
"""A device plugin's non-UUID device ID → the GPU or MIG UUID it names."""
Specs = Mapping[str, Edits | None]
"""CDI devices defined on the node, by qualified name (see cdi.SpecDirs)."""


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


def own_cdi_devices(resources: Sequence[ClaimResource]) -> list[tuple[str, ...]]:
    """The CDI devices each of a claim's devices was prepared with, as the driver said.

    Kubelets 1.35 to 1.37 list, for the devices one driver prepared for one claim, each
    device's CDI devices together with those of the devices before it (they are appended to
    one list kept across the driver's devices): the second of two GPUs names both GPUs' CDI
    devices. Where a device's list begins with the whole list of the driver's device before
    it, only the rest is its own; a list equal to it names nothing of its own."""
    owned: list[tuple[str, ...]] = []
    before: tuple[str, ...] = ()
    driver: str | None = None
    for resource in resources:
        names = resource.cdi_devices
        if resource.driver_name == driver and before and names[: len(before)] == before:
            owned.append(names[len(before) :])
        else:
            owned.append(names)
        before, driver = names, resource.driver_name
    return owned


def _claim_devices(
    pod: PodResources, node: NodeGpus, specs: Specs
) -> tuple[list[KubeletClaimDevice], int]:
    """The DRA devices of the pod's containers, once each (a claim several containers share
    is listed by each), and how many could not be listed (not names the API admits)."""
    found: dict[tuple[str, str, str, str], tuple[str, ...]] = {}
    for container in pod.containers:
        for dynamic in container.dynamic_resources:
            owned = own_cdi_devices(dynamic.claim_resources)
            for resource, names in zip(dynamic.claim_resources, owned, strict=True):
                key = (
                    dynamic.claim_name,
                    resource.driver_name,
                    resource.pool_name,
                    resource.device_name,
                )
                found[key] = tuple(dict.fromkeys(found.get(key, ()) + names))
    devices: list[KubeletClaimDevice] = []
    invalid = 0
    for (claim, driver, pool, device), names in sorted(found.items()):
        try:
            devices.append(
                KubeletClaimDevice(
                    claim=claim,
                    driver=driver,
                    pool=pool,
                    device=device,
                    uuid=resolve(names, specs, node),
                )
            )
        except ValidationError:
            invalid += 1
    return devices, invalid


def _entry(
    pod: PodResources,
    extra: Iterable[str],
    aliases: Aliases,
    node: NodeGpus,
    specs: Specs,
) -> KubeletPod | None:
    """The pod's GPU devices and DRA devices; None when it was given neither (or names
    nothing valid)."""
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
    claimed, unlisted = _claim_devices(pod, node, specs)
    if not (resources or other or claimed or unlisted):
        return None
    if len(resources) > MAX_RESOURCES:
        other += len(devices)
        devices.clear()
        replicas.clear()
    if len(claimed) > MAX_POD_CLAIM_DEVICES:  # its claims' devices untold, never in part
        unlisted += len(claimed)
        claimed = []
    try:
        return KubeletPod(
            namespace=pod.namespace,
            name=pod.name,
            resources=sorted(resources)[:MAX_RESOURCES],
            devices=sorted(devices),
            other_devices=min(other, MAX_COUNTED),
            replicas=_replicas({d: len(ids) for d, ids in replicas.items()})[:MAX_POD_REPLICATED],
            claim_devices=claimed,
            omitted_claim_devices=min(unlisted, MAX_COUNTED),
        )
    except ValidationError:
        return None  # not a pod name the API admits: it cannot be matched to a pod anyway


def allocations(
    pods: Sequence[PodResources],
    extra: Iterable[str] = (),
    aliases: Aliases | None = None,
    advertised: Sequence[ContainerDevices] | None = None,
    replicas_unknown: str | None = None,
    *,
    node: NodeGpus | None = None,
    specs: Specs | None = None,
    dra_unknown: str | None = None,
) -> KubeletAllocations:
    """The report's `kubelet` section: pods given GPU resources by a device plugin or devices
    by a DRA driver, in name order, within the bounds (pods past them are counted as omitted,
    never listed in part; a pod past the bound on DRA devices is listed with its DRA devices
    counted instead); `aliases` map other plugins' device IDs to UUIDs (see device_aliases);
    `advertised`, the devices the plugins advertise (GetAllocatableResources), tell the devices
    shared as replicas, or `replicas_unknown` why they could not be read; `node` and `specs`
    (the CDI devices defined on the node) give DRA devices their UUIDs; `dra_unknown` says what
    of the DRA devices the kubelet could not tell."""
    extra = tuple(extra)
    known = aliases or {}
    gpus = node or NodeGpus.of(())
    cdi = specs or {}
    entries = sorted(
        (e for e in (_entry(p, extra, known, gpus, cdi) for p in pods) if e is not None),
        key=lambda e: (e.namespace, e.name),
    )
    listed: list[KubeletPod] = []
    devices = replicas = claimed = 0
    for entry in entries:
        if len(listed) == MAX_KUBELET_PODS or devices + len(entry.devices) > MAX_KUBELET_DEVICES:
            break
        update: dict[str, object] = {}
        if replicas + len(entry.replicas) > MAX_KUBELET_REPLICAS:  # its shares untold, not wrong
            update["replicas"] = []
        else:
            replicas += len(entry.replicas)
        if claimed + len(entry.claim_devices) > MAX_KUBELET_CLAIM_DEVICES:
            update["claim_devices"] = []
            update["omitted_claim_devices"] = min(
                entry.omitted_claim_devices + len(entry.claim_devices), MAX_COUNTED
            )
        else:
            claimed += len(entry.claim_devices)
        listed.append(entry.model_copy(update=update) if update else entry)
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
        dra_message=safe_text(dra_unknown, MAX_MESSAGE) if dra_unknown else None,
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


def get_nothing(path: Path, timeout: float) -> bytes:
    """Get for a pod with no name in no namespace: an error from any kubelet, which one
    telling what the kubelet serves."""
    return unary(path, GET, get_request("", ""), timeout)


def lists_dra(pods: Iterable[PodResources]) -> bool:
    """Whether the answer lists any DRA device: a kubelet that does is one that can."""
    return any(c.dynamic_resources for p in pods for c in p.containers)


def get_verdict(ask: Callable[[], bytes]) -> str | None:
    """What a List answer without DRA devices means, from the kubelet's `Get` for a pod that
    cannot exist (no name, no namespace: never a race with a pod leaving): None where the
    kubelet serves Get, so it can list DRA devices and has none to list; else why the DRA
    devices are not known."""
    try:
        get_response(ask())
    except CallError as exc:
        said = str(exc)
        if said.startswith("Unimplemented"):
            return (
                "the kubelet has no PodResources Get (before Kubernetes 1.27), nor the DRA "
                "devices in List: pods' claims are known from the API alone"
            )
        if "disabled" in said:
            return (
                "the kubelet's PodResources Get is turned off (the KubeletPodResourcesGet gate, "
                "off by default before Kubernetes 1.34), and so, most likely, the DRA devices "
                "in List (KubeletPodResourcesDynamicResources, at the same stage): pods' claims "
                "are known from the API alone"
            )
        if not said.startswith(("NotFound", "InvalidArgument")) and "not found" not in said:
            return f"Get: {said}: whether the kubelet lists DRA devices is not known"
    except (OSError, WireError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"Get: {why}: whether the kubelet lists DRA devices is not known"
    return None  # the kubelet's "pod  in namespace  not found": it serves Get


class Kubelet:
    """Asks the kubelet's pod-resources socket when its answer may have changed.

    A pod's devices are fixed for its life, so the answer matters anew only when a pod the
    agent has not seen yet uses a GPU (asked in that very cycle, after its processes were
    read), after a failure (asked every cycle until it works), and otherwise every `refresh`
    seconds (pods that left). Asking every cycle would cost about a quarter of a cycle's CPU
    (benchmarks/README.md).

    With an answer that lists DRA devices the node's CDI specs are read (`cdi`, each file
    parsed once per change) to give them UUIDs; an answer that lists none is followed by a
    `Get`, which tells whether the kubelet could have listed any (see get_verdict).

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
        cdi: SpecDirs | None = None,
        lister: Lister = list_pods,
        allocatable: Lister = list_allocatable,
        getter: Lister = get_nothing,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket = socket
        self.timeout = timeout
        self.extra = tuple(extra_resources)
        self.refresh = refresh
        self.cdi = cdi if cdi is not None else SpecDirs()
        self.lister = lister
        self.allocatable = allocatable
        self.getter = getter
        self.clock = clock
        self.enabled = socket.parent.is_dir()
        self.asked = 0
        """Times the kubelet was asked."""
        self._last: KubeletAllocations | None = None
        self._raw: Sequence[PodResources] | None = None
        """The kubelet's last answer, kept to translate again when the node's GPUs change."""
        self._advertised: Sequence[ContainerDevices] | None = None
        self._replicas_unknown: str | None = None
        self._specs: Specs = {}
        self._dra_unknown: str | None = None
        self._aliases: Aliases = {}
        self._node = NodeGpus.of(())
        self._asked_at = 0.0
        self._known_pods: frozenset[str] = frozenset()
        self._last_failure: str | None = None
        if not self.enabled:
            log.info("%s is not mounted: allocations are known as counts only", socket.parent)

    def read(
        self, pods: Collection[str] = (), gpus: Sequence[Gpu] = ()
    ) -> KubeletAllocations | None:
        """The allocations for a cycle whose processes belong to `pods` (UIDs), device IDs and
        CDI devices mapped to UUIDs through the node's `gpus` (see device_aliases, cdi)."""
        if not self.enabled:
            return None
        now = self.clock()
        aliases = device_aliases(gpus)
        node = NodeGpus.of(gpus)
        if (
            self._last is not None
            and self._last.state == "Read"
            and self._known_pods.issuperset(pods)
            and now - self._asked_at < self.refresh
        ):
            if (aliases != self._aliases or node != self._node) and self._raw is not None:
                self._aliases, self._node = aliases, node
                self._last = self._translate(self._raw)
            return self._last
        self.asked += 1
        self._asked_at = now
        self._known_pods = frozenset(pods)
        self._aliases, self._node = aliases, node
        self._last = self._ask()
        return self._last

    def _ask(self) -> KubeletAllocations:
        try:
            self._raw = list_response(self.lister(self.socket, self.timeout))
            self._ask_allocatable()
            self._read_dra(self._raw)
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

    def _read_dra(self, pods: Sequence[PodResources]) -> None:
        """The CDI specs for an answer with DRA devices that name CDI devices; the Get for an
        answer without DRA devices. Neither fails the answer: what is missing is said."""
        why: str | None = None
        self._specs = {}
        if not lists_dra(pods):
            why = get_verdict(lambda: self.getter(self.socket, self.timeout))
        elif any(
            r.cdi_devices
            for p in pods
            for c in p.containers
            for d in c.dynamic_resources
            for r in d.claim_resources
        ):
            if any(folder.is_dir() for folder in self.cdi.dirs):
                self._specs = self.cdi.devices()
            else:
                folders = ", ".join(str(d) for d in self.cdi.dirs) or "none given"
                why = (
                    f"no CDI spec folder ({folders}) is mounted: the DRA devices' UUIDs are "
                    "not known from the node"
                )
        if why is not None and why != self._dra_unknown:  # a lasting gap is logged once
            log.warning("the kubelet's DRA devices: %s", why)
        self._dra_unknown = why

    def _translate(self, raw: Sequence[PodResources]) -> KubeletAllocations:
        return allocations(
            raw,
            self.extra,
            self._aliases,
            self._advertised,
            self._replicas_unknown,
            node=self._node,
            specs=self._specs,
            dra_unknown=self._dra_unknown,
        )

    def _failed(self, why: str) -> KubeletAllocations:
        if why != self._last_failure:  # a lasting failure is logged once
            self._last_failure = why
            log.warning("reading the kubelet's pod resources failed: %s", why)
        return unavailable(why)
