"""What the cluster handed a pod, and whether its use stays inside it. Pure (what the pod
asks for is read in `requests`).

Three ways a pod gets a GPU, each counted (`sources`):

* **DevicePlugin**: `nvidia.com/gpu`, `nvidia.com/mig-<profile>` and any configured extra
  resource name (HAMi's, a vendor's variant) in its containers' limits: a count in the pod;
  which devices the kubelet chose, the agent reads from the kubelet's PodResources API and
  publishes in its report (`spec.kubelet`), by pod namespace and name.
* **DRA**: its ResourceClaims whose allocation results come from a configured driver
  (`gpu.nvidia.com` by default), each result mapped through its ResourceSlice to the device's
  UUID (a MIG device without one, created at prepare time, by its parent GPU and profile), and
  the claim the scheduler made for its GPU resources that a DRA driver serves (KEP-5004): that
  claim's devices are its GPUs (whatever the driver), and the resources it serves are no
  device-plugin request (see index.pods). Where the claim cannot be read from the API (no DRA
  served or readable, the claim not found) or a result's device is in no slice, the devices
  the kubelet lists for the claim with their UUIDs (the agent's `spec.kubelet`) stand in; a
  claim the kubelet lists nothing for stays unknown, never "none". A device several claims
  share (`allowMultipleAllocations`, KEP-5075) is each one's allocation, and what its claim
  consumed of it is its part: memory capacity the GPU memory it was handed, a `shares` or
  `cores` capacity its share of the device's time (see consumed_part).
* **Fractional**: a scheduler's share in the pod's annotations (KAI / Run:ai `gpu-fraction`,
  `gpu-memory`; configurable): a share of some GPU.

Two findings follow, and nothing is judged where the allocation cannot be known:

* `Unrequested`: the pod uses a GPU and has no allocation of any kind. A pod whose claims
  cannot be read (the claim is not there yet, the cluster serves no DRA API to the operator)
  is never called unrequested, nor one the kubelet lists with GPU devices.
* `Unallocated`: the pod's allocation is known device by device (every source: the kubelet's
  device IDs are all devices of this node and cover every GPU resource the pod requests, every
  DRA result is mapped; a fractional share never is) and it uses a device outside it. A MIG
  device counts as inside when it is allocated itself, when its parent GPU is allocated whole,
  or (dynamic MIG) when an allocated device without a UUID has its parent GPU and profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from gpuusage.api.models import MAX_MIB, GpuNodeUsageSpec, KubeletClaimDevice, KubeletPod
from gpuusage.api.resources import mig_profile
from gpuusage_operator.index.dra import (
    NO_DRA,
    ClaimResult,
    ClaimSnapshot,
    DraLookup,
    SliceDevice,
)
from gpuusage_operator.judge.requests import DEFAULT_RULES, AllocationRules, PodClaims

if TYPE_CHECKING:
    from gpuusage_operator.judge.resolution import PodUse

Source = Literal["DevicePlugin", "DRA", "Fractional"]
Match = Literal["UUID", "ParentAndProfile"]
Finding = Literal["Unrequested", "Unallocated"]


@dataclass(frozen=True)
class AllocatedDevice:
    """One device a pod got: its UUID, or for a dynamic MIG device its parent and profile."""

    via: str
    """Where it is known from: "claim <name>", or "kubelet"."""
    uuid: str | None
    parent_uuid: str | None = None
    profile: str | None = None
    share: float | None = None
    """The share of its time the pod was handed: the part its claim consumed of a shared
    device or the claim's split among its pods (see handed_part), or its share as one of the
    device plugin's time-slicing replicas (see replica_share); None: the device is the pod's
    own, or nothing says."""
    replicas: int = 0
    """How many of the device plugin's time-slicing replicas of it the pod holds, where the
    replicas the device is advertised as are known (its share then says of how many)."""
    memory_mib: int | None = None
    """The GPU memory handed with it where its claim consumed part of a shared device's
    memory capacity (see consumed_part); None: its memory is not parted out."""
    partial: bool = False
    """A part of a device several claims share (`allowMultipleAllocations`): showback counts
    the part (its share, its memory), not a GPU."""

    @property
    def match(self) -> Match:
        return "UUID" if self.uuid else "ParentAndProfile"

    @property
    def shown(self) -> str:
        return self.uuid or f"{self.parent_uuid}/{self.profile}"

    @property
    def from_claim(self) -> bool:
        """Got through a DRA claim (not the kubelet's view of a device-plugin request)."""
        return self.via.startswith("claim ")

    @property
    def is_mig(self) -> bool:
        """A MIG slice: a MIG UUID, or one created at prepare time (parent and profile)."""
        return self.uuid is None or self.uuid.startswith("MIG-")


@dataclass(frozen=True)
class Allocation:
    sources: tuple[Source, ...] = ()
    devices: tuple[AllocatedDevice, ...] = ()
    complete: bool = False
    """`devices` is the whole allocation (every source known device by device)."""
    unknown: str = ""
    """Why part of the allocation cannot be known (a claim not found, DRA unreadable)."""
    detail: str = ""
    """The allocation in words, for messages: "1 nvidia.com/gpu", "claim train-gpu: GPU-…"."""


@dataclass(frozen=True)
class KubeletView:
    """The report's `kubelet` section as a lookup by pod (empty: not read, or unavailable)."""

    pods: Mapping[tuple[str, str], KubeletPod] = field(default_factory=dict)
    known: frozenset[str] = frozenset()
    """Every GPU and MIG UUID of the report: a kubelet ID outside it is not a device we see."""
    replicated: Mapping[str, int] = field(default_factory=dict)
    """Devices the device plugins advertise as time-slicing replicas: how many."""
    dra: bool = False
    """The kubelet's DRA devices are read (no `draMessage`): a claim's devices it lists are
    what its drivers prepared."""

    @classmethod
    def of(cls, spec: GpuNodeUsageSpec) -> KubeletView:
        if spec.kubelet is None or spec.kubelet.state != "Read":
            return cls()
        known = {g.uuid for g in spec.gpus if g.uuid} | {
            m.uuid for g in spec.gpus for m in g.mig_devices
        }
        pods = {(p.namespace, p.name): p for p in spec.kubelet.pods}
        replicated = {r.device: r.replicas for r in spec.kubelet.replicated}
        return cls(pods, frozenset(known), replicated, spec.kubelet.dra_message is None)

    def prepared(self, pod: PodClaims, claim: str) -> list[KubeletClaimDevice] | None:
        """The devices the kubelet lists for one of the pod's claims, where it lists them
        all; None where nothing is known of them from the node (not read, the pod not listed,
        nothing listed for the claim, some left out)."""
        entry = self.pods.get((pod.namespace, pod.name))
        if not self.dra or entry is None or entry.omitted_claim_devices:
            return None
        listed = [d for d in entry.claim_devices if d.claim == claim]
        return listed or None


NO_KUBELET = KubeletView()


def _plugin_devices(pod: PodClaims, kubelet: KubeletView) -> list[AllocatedDevice] | None:
    """The devices the kubelet gave the pod, when they are known one by one: listed, all of
    this node, none under a plugin's own name, every requested GPU resource among them."""
    entry = kubelet.pods.get((pod.namespace, pod.name))
    if (
        entry is None
        or entry.other_devices
        or not entry.devices
        or not set(pod.resources) <= set(entry.resources)
        or not set(entry.devices) <= kubelet.known
    ):
        return None
    given = {r.device: r.replicas for r in entry.replicas}
    devices = []
    for uuid in entry.devices:
        share = replica_share(given.get(uuid, 0), kubelet.replicated.get(uuid))
        held = given.get(uuid, 0) if share is not None else 0
        devices.append(AllocatedDevice("kubelet", uuid, share=share, replicas=held))
    return devices


def replica_share(given: int, advertised: int | None) -> float | None:
    """The share of a device's time a pod given `given` of its `advertised` time-slicing
    replicas was handed; None where it holds no replica or the replicas are not known."""
    if not given or not advertised:
        return None
    return min(given / advertised, 1.0)


def claim_share(claim: ClaimSnapshot, users: int) -> float | None:
    """The share of its devices' time a claim hands each of the `users` running pods that name
    it: MPS's active thread percentage where set, else an equal part among them (time-slicing
    promises no more); None for a claim that shares nothing or one pod alone (its device is
    its own)."""
    if claim.sharing is None:
        return None
    if claim.sharing == "MPS" and claim.thread_percent is not None:
        return claim.thread_percent / 100
    return 1 / users if users > 1 else None


MEMORY_CAPACITY = "memory"
"""The capacity whose consumed part is GPU memory (bytes): NVIDIA's and HAMi's drivers."""
TIME_CAPACITIES = ("shares", "cores")
"""Capacities whose consumed part over the whole is a share of the device's time: NVIDIA's
consumable `shares` (one of N co-tenants), HAMi's `cores` (a percentage of the SMs, which
HAMi-core enforces)."""


def consumed_part(device: SliceDevice, result: ClaimResult) -> tuple[float | None, int | None]:
    """What an allocation of a device several claims share consumed of it: the share of its
    time (a time capacity consumed over the device's) and the GPU memory in MiB; None for
    either where nothing says (a device not shared, nothing consumed: a driver that parts out
    no memory consumes 0 of it)."""
    if not (device.multiple or result.share_id):
        return None, None
    share = None
    for name in TIME_CAPACITIES:
        total, used = device.amount(name), result.amount(name)
        if total and used and total > 0 and used > 0:
            share = min(used / total, 1.0)
            break
    memory = result.amount(MEMORY_CAPACITY)
    mib = int(min(memory, MAX_MIB * 2.0**20) // 2**20) if memory and memory > 0 else 0
    return share, mib or None


@dataclass(frozen=True)
class ClaimDevices:
    """What one claim of a pod got, as far as GPUs go."""

    devices: tuple[AllocatedDevice, ...] = ()
    unknown: tuple[str, ...] = ()
    gpus: bool = False
    """It is a GPU allocation (GPU results, or the pod's GPU resources it serves)."""


def _is_gpu_uuid(uuid: str | None) -> bool:
    return bool(uuid) and str(uuid).startswith(("GPU-", "MIG-"))


def _from_node(
    name: str,
    listed: list[KubeletClaimDevice] | None,
    rules: AllocationRules,
    extended: bool,
    why: str,
) -> ClaimDevices:
    """A claim's GPUs as the kubelet lists them, where the API cannot tell (`why`): a device
    with a GPU or MIG UUID is a GPU; one of a GPU driver without one, or of the pod's
    extended-resource claim, is a GPU not known by device; nothing listed is nothing known."""
    if listed is None:
        return ClaimDevices(unknown=(f"claim {name}: {why}",), gpus=extended)
    devices, unknown = [], []
    for d in listed:
        if _is_gpu_uuid(d.uuid):
            devices.append(AllocatedDevice(f"claim {name}", d.uuid))
        elif extended or d.driver in rules.dra_drivers:
            unknown.append(f"claim {name}: device {d.device} has no UUID on the node")
    return ClaimDevices(tuple(devices), tuple(unknown), bool(devices or unknown or extended))


def handed_part(part: float | None, claim: ClaimSnapshot, users: int) -> float | None:
    """A pod's share of a device's time: the part its claim consumed of a shared device, split
    among the running pods naming the claim (equally, as its memory is, unless the claim's
    config says how: MPS's thread percentage, of the whole device); None where nothing says."""
    split = claim_share(claim, users)
    if part is None:
        return split
    if split is None:
        return part / users if users > 1 else part
    return split if claim.thread_percent is not None else part * split


def _from_api(
    pod: PodClaims,
    claim: ClaimSnapshot,
    dra: DraLookup,
    rules: AllocationRules,
    listed: list[KubeletClaimDevice] | None,
) -> ClaimDevices:
    """A claim's GPU results, each mapped through its slice (else the kubelet's UUID for it),
    with the part of a shared device it consumed."""
    name = claim.name
    requests = pod.extended_requests if name == pod.extended_claim else ()
    results = [
        r
        for r in claim.results
        if r.driver in rules.dra_drivers or r.request.split("/")[0] in requests
    ]
    on_node = {(d.driver, d.pool, d.device): d.uuid for d in listed or [] if _is_gpu_uuid(d.uuid)}
    users = max(dra.users(pod.namespace, name), 1)
    devices, unknown = [], []
    for result in results:
        device = dra.device(result) or SliceDevice(result.driver, result.pool, result.device)
        uuid = device.uuid or on_node.get((result.driver, result.pool, result.device))
        if not (uuid or (device.parent_uuid and device.profile)):
            unknown.append(f"claim {name}: device {result.device} not in any ResourceSlice")
            continue
        part, memory = consumed_part(device, result)
        devices.append(
            AllocatedDevice(
                f"claim {name}",
                uuid,
                device.parent_uuid,
                device.profile,
                handed_part(part, claim, users),
                memory_mib=memory // users if memory else None,
                partial=device.multiple or result.share_id is not None,
            )
        )
    return ClaimDevices(tuple(devices), tuple(unknown), bool(results or requests))


def claim_devices(
    pod: PodClaims, name: str, dra: DraLookup, rules: AllocationRules, kubelet: KubeletView
) -> ClaimDevices:
    """What one claim the pod names got (see the module's docstring)."""
    extended = name == pod.extended_claim and bool(pod.extended_requests)
    listed = kubelet.prepared(pod, name)
    claim = dra.claim(pod.namespace, name)
    if claim is None or not claim.allocated:
        why = "DRA cannot be read" if not dra.available else "not found or not allocated"
        return _from_node(name, listed, rules, extended, why)
    return _from_api(pod, claim, dra, rules, listed)


def allocation_of(
    pod: PodClaims,
    dra: DraLookup,
    rules: AllocationRules,
    kubelet: KubeletView = NO_KUBELET,
) -> Allocation:
    sources: list[Source] = []
    words: list[str] = []
    devices: list[AllocatedDevice] = []
    unknown: list[str] = []
    entry = kubelet.pods.get((pod.namespace, pod.name))
    # Listed for a device plugin's devices: the DRA devices the kubelet lists are the claims'.
    listed = entry is not None and bool(entry.devices or entry.other_devices)
    if pod.gpu_requests > 0 or listed:
        sources.append("DevicePlugin")
        count = pod.gpu_requests
        words.append(
            f"{count} GPU{'s' if count != 1 else ''} (device plugin)"
            if count
            else "GPUs the kubelet lists"
        )
        # Only for a pod whose own request names the resources: the kubelet's entry must cover
        # each of them, which cannot be checked for resources the operator does not count.
        given = _plugin_devices(pod, kubelet) if pod.resources else None
        if given is None:
            unknown.append("the device plugin's devices are not known one by one")
        else:
            devices.extend(given)
    if pod.fraction:
        sources.append("Fractional")
        words.append(f"a share ({pod.fraction})")
    if pod.pending_claims:
        unknown.append(f"{pod.pending_claims} claim(s) not generated yet")
    for name in dict.fromkeys(pod.claim_names):
        found = claim_devices(pod, name, dra, rules, kubelet)
        devices.extend(found.devices)
        unknown.extend(found.unknown)
        if found.gpus:
            words.append(f"claim {name}")
    if any(w.startswith("claim ") for w in words):
        sources.append("DRA")
    complete = bool(sources) and "Fractional" not in sources and not unknown
    if devices:
        words.append("devices " + ", ".join(d.shown for d in devices))
    return Allocation(
        tuple(sources), tuple(devices), complete, "; ".join(unknown), "; ".join(words)
    )


@dataclass(frozen=True)
class DeviceFacts:
    """What the report says of the devices in use: a MIG device's parent GPU and profile."""

    mig_parent: Mapping[str, str] = field(default_factory=dict)
    mig_profile: Mapping[str, str] = field(default_factory=dict)


def device_facts(spec: GpuNodeUsageSpec) -> DeviceFacts:
    parents: dict[str, str] = {}
    profiles: dict[str, str] = {}
    for gpu in spec.gpus:
        for mig in gpu.mig_devices:
            if gpu.uuid:
                parents[mig.uuid] = gpu.uuid
            profile = mig_profile(mig.name)
            if profile:
                profiles[mig.uuid] = profile
    return DeviceFacts(parents, profiles)


def inside(device: str, allocation: Allocation, facts: DeviceFacts) -> bool:
    """Whether a used device (GPU or MIG UUID) is within a device-level allocation."""
    parent, profile = facts.mig_parent.get(device), facts.mig_profile.get(device)
    for given in allocation.devices:
        if given.uuid is not None and given.uuid in (device, parent):
            return True
        if (
            given.uuid is None
            and parent
            and (given.parent_uuid, given.profile)
            == (
                parent,
                profile,
            )
        ):
            return True
    return False


def finding(
    allocation: Allocation, used: Sequence[str], facts: DeviceFacts
) -> tuple[Finding | None, list[str]]:
    """The finding for a pod using `used`, and the devices outside its allocation."""
    if not allocation.sources:
        return (None, []) if allocation.unknown else ("Unrequested", list(used))
    if not allocation.complete:
        return None, []
    outside = [d for d in used if not inside(d, allocation, facts)]
    return ("Unallocated", outside) if outside else (None, [])


@dataclass(frozen=True)
class Judgement:
    """A pod's allocation and what its use means against it."""

    allocation: Allocation
    finding: Finding | None = None
    outside: tuple[str, ...] = ()
    """The used devices outside the allocation (for Unallocated)."""
    held_idle_since: datetime | None = None
    """Since when the pod holds memory and computes nothing, once that is a finding (see
    holding); the allocation findings come first."""


def judge(
    pod: PodClaims,
    used: Sequence[str],
    dra: DraLookup,
    rules: AllocationRules,
    facts: DeviceFacts,
    *,
    kubelet: KubeletView = NO_KUBELET,
) -> Judgement:
    allocation = allocation_of(pod, dra, rules, kubelet)
    found, outside = finding(allocation, used, facts)
    return Judgement(allocation, found, tuple(outside))


def judgements(
    uses: Mapping[str, PodUse],
    spec: GpuNodeUsageSpec,
    dra: DraLookup = NO_DRA,
    rules: AllocationRules = DEFAULT_RULES,
) -> dict[str, Judgement]:
    """Each using pod's judgement, by UID (the defaults know no claims: nothing is judged
    unrequested for a pod that has some)."""
    facts = device_facts(spec)
    kubelet = KubeletView.of(spec)
    return {
        uid: judge(use.pod.claimed, use.devices, dra, rules, facts, kubelet=kubelet)
        for uid, use in uses.items()
    }
