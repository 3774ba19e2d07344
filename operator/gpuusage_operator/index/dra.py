"""Dynamic Resource Allocation, read as the operator needs it: which devices a claim got. Pure.

A pod names its claims in `spec.resourceClaims[]` (a `resourceClaimName`, or a template whose
generated claim `status.resourceClaimStatuses[]` names). A ResourceClaim's
`status.allocation.devices.results[]` says (driver, pool, device) per request, and the
ResourceSlice of that driver and pool describes the device: NVIDIA's driver (`gpu.nvidia.com`)
gives a GPU its `uuid` attribute and a MIG device its `uuid`, `parentUUID` and `profile`. A MIG
device created at prepare time (dynamic MIG) has no `uuid` in the slice: it can be matched only
by its parent GPU and its profile, and is said to be matched so.

The states below are what the informers keep (see informers.dra): a few fields per object, never
whole bodies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SliceDevice:
    """One device a ResourceSlice publishes."""

    driver: str
    pool: str
    name: str
    uuid: str | None = None
    parent_uuid: str | None = None
    profile: str | None = None


@dataclass(frozen=True)
class ClaimResult:
    """One allocated device of a claim."""

    driver: str
    pool: str
    device: str


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
    consumers: int = 0
    """The pods the claim is reserved for (`status.reservedFor`): who share its devices."""


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
    for device in spec.get("devices") or []:
        if not device.get("name"):
            continue
        # v1beta1 nests them under `basic`; v1beta2 and v1 do not
        attributes = device.get("attributes") or (device.get("basic") or {}).get("attributes") or {}
        found.append(
            SliceDevice(
                driver=str(driver),
                pool=str(pool),
                name=str(device["name"]),
                uuid=_attribute(attributes, "uuid"),
                parent_uuid=_attribute(attributes, "parentUUID"),
                profile=_attribute(attributes, "profile"),
            )
        )
    return tuple(found)


def claim_snapshot(body: Mapping[str, Any]) -> ClaimSnapshot | None:
    meta = body.get("metadata") or {}
    if not meta.get("uid") or not meta.get("name"):
        return None
    allocation = (body.get("status") or {}).get("allocation")
    results = tuple(
        ClaimResult(str(r["driver"]), str(r["pool"]), str(r["device"]))
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
        consumers=len((body.get("status") or {}).get("reservedFor") or []),
    )


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


@dataclass(frozen=True)
class DraLookup:
    """What the operator knows of claims and slices; `available` is False where the cluster
    serves no DRA API or the operator may not read it (then nothing about claims is known)."""

    claims: Mapping[tuple[str, str], ClaimSnapshot] = field(default_factory=dict)
    devices: Mapping[DeviceKey, SliceDevice] = field(default_factory=dict)
    available: bool = True

    def claim(self, namespace: str, name: str) -> ClaimSnapshot | None:
        return self.claims.get((namespace, name)) if self.available else None

    def device(self, result: ClaimResult) -> SliceDevice | None:
        return self.devices.get((result.driver, result.pool, result.device))


NO_DRA = DraLookup(available=False)
