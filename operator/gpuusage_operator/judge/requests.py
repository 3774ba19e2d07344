"""What a pod asks for: its GPU resources, the scheduler's share in its annotations, and the
rules that say which names count. Pure.

Read from the pod alone, when the pod index takes it in (see index.pods); judging use against
what was handed is `allocation`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuusage.api.models import MAX_MIB, MAX_SHARE
from gpuusage.api.resources import MIG_RESOURCE_PREFIX, is_gpu_resource


@dataclass(frozen=True)
class AllocationRules:
    """Which resource names, annotations and DRA drivers count as handing out a GPU."""

    extra_resources: tuple[str, ...] = ()
    fraction_annotations: tuple[str, ...] = ("gpu-fraction", "gpu-memory")
    dra_drivers: tuple[str, ...] = ("gpu.nvidia.com",)

    def counts(self, resource: str) -> bool:
        return is_gpu_resource(resource, self.extra_resources)


DEFAULT_RULES = AllocationRules()


def _gpus_in(resources: Mapping[str, Any] | None, counts: Callable[[str], bool]) -> int:
    """GPUs in one container's limits (extended resources: requests equal limits)."""
    limits = (resources or {}).get("limits") or (resources or {}).get("requests") or {}
    total = 0
    for name, value in limits.items():
        if counts(name):
            try:
                total += int(str(value))
            except ValueError:
                continue  # not a whole number: not something a device plugin hands out
    return total


def without_served(spec: Mapping[str, Any], served: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """The pod's spec without the (container, resource) requests a DRA driver serves (an
    extended-resource claim's; see index.dra.extended_claim): a device plugin hands them no
    device, so they are no device-plugin request, and the claim's devices count them."""
    gone = set(served)
    if not gone:
        return dict(spec)

    def container(c: Mapping[str, Any]) -> dict[str, Any]:
        name, resources = c.get("name"), c.get("resources") or {}
        kept = {
            kind: {k: v for k, v in (resources.get(kind) or {}).items() if (name, k) not in gone}
            for kind in ("requests", "limits")
        }
        return {**c, "resources": kept}

    return {
        **spec,
        "containers": [container(c) for c in spec.get("containers") or []],
        "initContainers": [container(c) for c in spec.get("initContainers") or []],
    }


def _requests(spec: Mapping[str, Any], counts: Callable[[str], bool]) -> int:
    """A pod's effective request of these resources, as the scheduler counts it: the larger of
    the sum over its containers and the largest init container."""
    regular = sum(_gpus_in(c.get("resources"), counts) for c in spec.get("containers") or [])
    init = max(
        (_gpus_in(c.get("resources"), counts) for c in spec.get("initContainers") or []),
        default=0,
    )
    return max(regular, init)


def gpu_requests(spec: Mapping[str, Any], rules: AllocationRules = DEFAULT_RULES) -> int:
    """The pod's effective device-plugin GPU request (whole GPUs and MIG slices together)."""
    return _requests(spec, rules.counts)


def mig_requests(spec: Mapping[str, Any]) -> int:
    """The MIG slices among them (`nvidia.com/mig-<profile>`)."""
    return _requests(spec, lambda name: name.startswith(MIG_RESOURCE_PREFIX))


def gpu_resources(
    spec: Mapping[str, Any], rules: AllocationRules = DEFAULT_RULES
) -> tuple[str, ...]:
    """The GPU resource names any of the pod's containers requests, sorted."""
    found: set[str] = set()
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = c.get("resources") or {}
        for name in {**(resources.get("requests") or {}), **(resources.get("limits") or {})}:
            if rules.counts(name):
                found.add(name)
    return tuple(sorted(found))


def fraction_of(annotations: Mapping[str, Any], rules: AllocationRules = DEFAULT_RULES) -> str:
    """The scheduler's share as `key=value` pairs (empty: none), e.g. "gpu-fraction=0.5"."""
    found = [f"{k}={annotations[k]}" for k in rules.fraction_annotations if annotations.get(k)]
    return ",".join(found)


@dataclass(frozen=True)
class Share:
    """A scheduler's share in numbers, where its annotations say them: a fraction of one GPU
    (an annotation whose name ends in `fraction`, as KAI's and Run:ai's gpu-fraction) and GPU
    memory in MiB (one ending in `memory`, as their gpu-memory)."""

    gpu: float | None = None
    memory_mib: int | None = None


def share_of(fraction: str) -> Share:
    """The numbers in fraction_of's text; what does not read as one is left out."""
    gpu: float | None = None
    memory: int | None = None
    for pair in fraction.split(",") if fraction else []:
        key, _, value = pair.partition("=")
        try:
            if key.endswith("fraction"):
                number = float(value)
                gpu = number if 0 < number <= MAX_SHARE else gpu
            elif key.endswith("memory"):
                mib = int(value)
                memory = mib if 0 < mib <= MAX_MIB else memory
        except ValueError:
            continue
    return Share(gpu, memory)


@dataclass(frozen=True)
class PodClaims:
    """What the pod itself says about its allocation (kept in the pod index)."""

    namespace: str
    name: str = ""
    gpu_requests: int = 0
    resources: tuple[str, ...] = ()
    """The GPU resource names its containers request."""
    fraction: str = ""
    claims: tuple[str, ...] = ()
    pending_claims: int = 0
    extended_claim: str = ""
    """The claim the scheduler made for its extended resources that a DRA driver serves (see
    index.dra.extended_claim); empty: none."""
    extended_requests: tuple[str, ...] = ()
    """That claim's requests standing for GPU resources: their devices are its GPUs."""

    @property
    def claim_names(self) -> tuple[str, ...]:
        return claim_names(self.claims, self.extended_claim)


def claim_names(claims: tuple[str, ...], extended_claim: str) -> tuple[str, ...]:
    """Every claim a pod names: those of its spec and status, and its extended-resource
    claim."""
    return (*claims, extended_claim) if extended_claim else claims
