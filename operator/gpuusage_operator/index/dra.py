"""Dynamic Resource Allocation, read as the operator needs it: which devices a claim got. Pure.

A pod names its claims in `spec.resourceClaims[]` (a `resourceClaimName`, or a template whose
generated claim `status.resourceClaimStatuses[]` names) and, where the scheduler served one of
its extended resources (`nvidia.com/gpu`) from a DRA driver whose DeviceClass names it
(`extendedResourceName`, KEP-5004), in `status.extendedResourceClaimStatus`: the special claim
the scheduler made for the pod, and which of its requests stands for which container's resource.
A ResourceClaim's `status.allocation.devices.results[]` says (driver, pool, device) per request,
with a `shareID` and the `consumedCapacity` where the device is shared by several claims
(`allowMultipleAllocations`, KEP-5075), and the ResourceSlice of that driver and pool describes
the device: NVIDIA's driver (`gpu.nvidia.com`) gives a GPU its `uuid` attribute and a MIG device
its `uuid`, `parentUUID` and `profile`, and both their `capacity` (`memory`, and `shares` where
consumable shares are on). A MIG device created at prepare time (dynamic MIG, drawn from its
GPU's `sharedCounters`, KEP-4815) has no `uuid` in the slice: it can be matched only by its
parent GPU and its profile, and is said to be matched so. A pool's counters may stand in a slice
of their own, without devices; counters say nothing of which device a claim got, so only the
devices are read.

Who uses a claim is told by the pods that name it, never by its `status.reservedFor`, which may
name a whole PodGroup (KEP-5729) rather than pods.

The states below are what the informers keep (see informers.drawatch): a few fields per
object, never whole bodies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Amounts = tuple[tuple[str, float], ...]
"""Capacities by name (the driver's own domain left out: `memory`, never
`gpu.nvidia.com/memory`), as numbers (memory in bytes)."""


@dataclass(frozen=True)
class SliceDevice:
    """One device a ResourceSlice publishes."""

    driver: str
    pool: str
    name: str
    uuid: str | None = None
    parent_uuid: str | None = None
    profile: str | None = None
    multiple: bool = False
    """`allowMultipleAllocations`: several claims may be allocated it, each consuming part of
    its capacity."""
    capacity: Amounts = ()

    def amount(self, name: str) -> float | None:
        return dict(self.capacity).get(name)


@dataclass(frozen=True)
class ClaimResult:
    """One allocated device of a claim."""

    driver: str
    pool: str
    device: str
    request: str = ""
    """The claim's request it was allocated for (`<request>/<subrequest>` for a subrequest)."""
    share_id: str | None = None
    """Set where the device is shared by several claims: which allocation of it this is."""
    consumed: Amounts = ()
    """The part of the device's capacity this allocation consumed (`consumedCapacity`)."""

    def amount(self, name: str) -> float | None:
        return dict(self.consumed).get(name)


_SUFFIX = {
    **{
        binary: 2.0 ** (10 * (i + 1))
        for i, binary in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))
    },
    **{decimal: 10.0 ** (3 * i - 9) for i, decimal in enumerate("num")},
    **{decimal: 10.0 ** (3 * (i + 1)) for i, decimal in enumerate("kMGTPE")},
}
_QUANTITY = re.compile(r"^([+-]?[0-9]*\.?[0-9]+)(" + "|".join(_SUFFIX) + r"|[eE][+-]?[0-9]+)?$")


MAX_QUANTITY = 64
"""The longest quantity read: far past any device's, short of what a float cannot hold."""


def quantity(value: object) -> float | None:
    """A Kubernetes quantity ("80Gi", "100", "500m", "1e3") as a number; None where it is
    none (the apiserver writes them canonical, so anything else is not read)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) else None
    found = _QUANTITY.match(value.strip()) if isinstance(value, str) else None
    if found is None or len(found.group(0)) > MAX_QUANTITY:
        return None
    number, suffix = float(found.group(1)), found.group(2)
    try:
        if suffix and suffix[0] in "eE" and len(suffix) > 1:
            number *= 10.0 ** int(suffix[1:])
        elif suffix:
            number *= _SUFFIX[suffix]
    except OverflowError:  # beyond any float: no device has it
        return None
    return number if math.isfinite(number) else None


def _amounts(values: Mapping[str, Any], driver: str, nested: bool) -> Amounts:
    """Named quantities, the driver's domain taken off their names; `nested`: each is
    `{"value": quantity}` (a slice's capacity) rather than the quantity (a consumed part)."""
    found: dict[str, float] = {}
    for name, raw in values.items():
        number = quantity((raw or {}).get("value") if nested and isinstance(raw, Mapping) else raw)
        if number is not None:
            short = name[len(driver) + 1 :] if name.startswith(driver + "/") else name
            found[str(short)] = number
    return tuple(sorted(found.items()))


@dataclass(frozen=True)
class ClaimSnapshot:
    namespace: str
    name: str
    uid: str
    allocated: bool
    results: tuple[ClaimResult, ...] = ()
    sharing: str | None = None
    """How its devices are shared where a device config says (NVIDIA's GpuConfig `sharing`
    strategy: `TimeSlicing` or `MPS`); None: not said."""
    thread_percent: int | None = None
    """MPS: the clients' default active thread percentage, where the config sets it."""


SHARING = ("TimeSlicing", "MPS")


def _sharing(body: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """The sharing strategy and MPS thread percentage the claim's device configs set (those
    the allocation carries, from its class and itself, else the claim's own)."""
    status, spec = body.get("status") or {}, body.get("spec") or {}
    configs = ((status.get("allocation") or {}).get("devices") or {}).get("config") or (
        (spec.get("devices") or {}).get("config") or []
    )
    for config in configs:
        parameters = ((config or {}).get("opaque") or {}).get("parameters") or {}
        sharing = parameters.get("sharing") if isinstance(parameters, Mapping) else None
        if not isinstance(sharing, Mapping) or sharing.get("strategy") not in SHARING:
            continue
        percent = (sharing.get("mpsConfig") or {}).get("defaultActiveThreadPercentage")
        valid = isinstance(percent, int) and not isinstance(percent, bool) and 0 < percent <= 100
        return str(sharing["strategy"]), percent if valid else None
    return None, None


def _attribute(attributes: Mapping[str, Any], name: str) -> str | None:
    """A device attribute's value (attributes are typed: {"string": ...}, {"version": ...})."""
    for key in (name, f"gpu.nvidia.com/{name}"):
        value = attributes.get(key)
        if isinstance(value, Mapping):
            for kind in ("string", "version"):
                if isinstance(value.get(kind), str) and value[kind]:
                    return str(value[kind])
    return None


def slice_devices(body: Mapping[str, Any]) -> tuple[SliceDevice, ...]:
    spec = body.get("spec") or {}
    driver = spec.get("driver")
    pool = (spec.get("pool") or {}).get("name")
    if not driver or not pool:
        return ()
    found = []
    for device in spec.get("devices") or []:  # none in a slice of shared counters alone
        if not device.get("name"):
            continue
        # v1beta1 nests a device's fields under `basic`; v1beta2 and v1 do not
        fields = device.get("basic") or device
        attributes = fields.get("attributes") or {}
        found.append(
            SliceDevice(
                driver=str(driver),
                pool=str(pool),
                name=str(device["name"]),
                uuid=_attribute(attributes, "uuid"),
                parent_uuid=_attribute(attributes, "parentUUID"),
                profile=_attribute(attributes, "profile"),
                multiple=fields.get("allowMultipleAllocations") is True,
                capacity=_amounts(fields.get("capacity") or {}, str(driver), nested=True),
            )
        )
    return tuple(found)


def claim_snapshot(body: Mapping[str, Any]) -> ClaimSnapshot | None:
    meta = body.get("metadata") or {}
    if not meta.get("uid") or not meta.get("name"):
        return None
    allocation = (body.get("status") or {}).get("allocation")
    results = tuple(
        ClaimResult(
            str(r["driver"]),
            str(r["pool"]),
            str(r["device"]),
            request=str(r.get("request") or ""),
            share_id=str(r["shareID"]) if r.get("shareID") else None,
            consumed=_amounts(r.get("consumedCapacity") or {}, str(r["driver"]), nested=False),
        )
        for r in ((allocation or {}).get("devices") or {}).get("results") or []
        if r.get("driver") and r.get("pool") and r.get("device")
    )
    sharing, percent = _sharing(body)
    return ClaimSnapshot(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta["name"]),
        uid=str(meta["uid"]),
        allocated=allocation is not None,
        results=results,
        sharing=sharing,
        thread_percent=percent,
    )


@dataclass(frozen=True)
class ExtendedClaim:
    """The claim the scheduler made for a pod's extended resources that a DRA driver serves
    (`status.extendedResourceClaimStatus`), as far as GPUs go."""

    name: str = ""
    """The claim's name (empty: the pod has none)."""
    requests: tuple[str, ...] = ()
    """Its requests that stand for a GPU resource of some container: their devices are GPUs,
    whatever driver serves them (the pod asked for GPUs)."""
    served: tuple[tuple[str, str], ...] = ()
    """(container, resource) pairs the claim serves: no device plugin hands them out, so they
    are not counted as a device-plugin request."""


def extended_claim(pod: Mapping[str, Any], counts: Callable[[str], bool]) -> ExtendedClaim:
    """The pod's extended-resource claim; `counts` says which resource names are GPUs."""
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    name = status.get("resourceClaimName")
    if not name:
        return ExtendedClaim()
    mappings = [m for m in status.get("requestMappings") or [] if isinstance(m, Mapping)]
    requests = sorted(
        {
            str(m["requestName"])
            for m in mappings
            if m.get("requestName") and counts(str(m.get("resourceName") or ""))
        }
    )
    served = sorted(
        {(str(m.get("containerName") or ""), str(m.get("resourceName") or "")) for m in mappings}
    )
    return ExtendedClaim(str(name), tuple(requests), tuple(served))


def pod_claims(pod: Mapping[str, Any]) -> tuple[tuple[str, ...], int]:
    """The names of the pod's ResourceClaims, and how many of its template claims have no
    generated claim named yet."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in status.get("resourceClaimStatuses") or []
        if s.get("name")
    }
    names: list[str] = []
    pending = 0
    for claim in spec.get("resourceClaims") or []:
        if claim.get("resourceClaimName"):
            names.append(str(claim["resourceClaimName"]))
        elif generated.get(claim.get("name")):
            names.append(str(generated[claim.get("name")]))
        elif claim.get("resourceClaimTemplateName"):
            pending += 1
    return tuple(names), pending


@dataclass
class ClaimState:
    """Claims by uid, and by namespace/name for lookups."""

    by_uid: dict[str, ClaimSnapshot] = field(default_factory=dict)
    by_name: dict[tuple[str, str], ClaimSnapshot] = field(default_factory=dict)

    def apply(self, event_type: str, body: Mapping[str, Any]) -> None:
        claim = claim_snapshot(body)
        if claim is None:
            return
        old = self.by_uid.pop(claim.uid, None)
        if old is not None:
            self.by_name.pop((old.namespace, old.name), None)
        if event_type != "DELETED":
            self.by_uid[claim.uid] = claim
            self.by_name[(claim.namespace, claim.name)] = claim

    def ids(self) -> set[str]:
        return set(self.by_uid)

    def __len__(self) -> int:
        return len(self.by_uid)


DeviceKey = tuple[str, str, str]
"""(driver, pool, device name)."""


@dataclass
class SliceState:
    """The devices of every ResourceSlice, by slice uid and by (driver, pool, device)."""

    by_uid: dict[str, tuple[SliceDevice, ...]] = field(default_factory=dict)
    devices: dict[DeviceKey, SliceDevice] = field(default_factory=dict)

    def apply(self, event_type: str, body: Mapping[str, Any]) -> None:
        uid = (body.get("metadata") or {}).get("uid")
        if not uid:
            return
        for old in self.by_uid.pop(str(uid), ()):
            key = (old.driver, old.pool, old.name)
            if self.devices.get(key) == old:
                del self.devices[key]
        if event_type != "DELETED":
            found = slice_devices(body)
            self.by_uid[str(uid)] = found
            for device in found:
                self.devices[(device.driver, device.pool, device.name)] = device

    def ids(self) -> set[str]:
        return set(self.by_uid)

    def __len__(self) -> int:
        return len(self.by_uid)


def _nobody(namespace: str, name: str) -> int:
    return 0


@dataclass(frozen=True)
class DraLookup:
    """What the operator knows of claims and slices; `available` is False where the cluster
    serves no DRA API or the operator may not read it (then nothing about claims is known).
    `users` counts the running pods that name a claim (the pod index's, see
    index.pods.PodLookup.claim_users): who share what it got."""

    claims: Mapping[tuple[str, str], ClaimSnapshot] = field(default_factory=dict)
    devices: Mapping[DeviceKey, SliceDevice] = field(default_factory=dict)
    available: bool = True
    users: Callable[[str, str], int] = _nobody

    def claim(self, namespace: str, name: str) -> ClaimSnapshot | None:
        return self.claims.get((namespace, name)) if self.available else None

    def device(self, result: ClaimResult) -> SliceDevice | None:
        return self.devices.get((result.driver, result.pool, result.device))


NO_DRA = DraLookup(available=False)
