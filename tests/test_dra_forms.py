"""The ways Kubernetes 1.36 and 1.37 DRA hands out GPUs, judged: DRA-backed extended resources
(KEP-5004), devices several claims share by consumable capacity (KEP-5075), partitionable
devices drawn from shared counters (KEP-4815), claims reserved for a PodGroup (KEP-5729), and
the kubelet's own view of each pod's claim devices. Tables over the pure rules."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from gpuusage.api.models import KubeletClaimDevice, KubeletPod, Process
from gpuusage_operator.index.dra import (
    NO_DRA,
    ClaimResult,
    ClaimState,
    DraLookup,
    SliceDevice,
    SliceState,
    claim_snapshot,
    quantity,
    slice_devices,
)
from gpuusage_operator.index.keptpods import KeptPods
from gpuusage_operator.index.pods import PodLookup, PodSnapshot, snapshot_of
from gpuusage_operator.judge.allocation import (
    AllocatedDevice,
    Allocation,
    DeviceFacts,
    Judgement,
    KubeletView,
    allocation_of,
    consumed_part,
    judge,
)
from gpuusage_operator.judge.requests import DEFAULT_RULES, AllocationRules, PodClaims
from gpuusage_operator.judge.resolution import PodUse, Resolution
from gpuusage_operator.judge.showback import pod_allocation
from gpuusage_operator.judge.status import handed_memory, handed_share, pod_usages

GPU0 = "GPU-00000000-1111-2222-3333-444444444444"
GPU1 = "GPU-11111111-1111-2222-3333-444444444444"
MIG_A = "MIG-aaaaaaaa-1111-2222-3333-444444444444"
MIG_B = "MIG-bbbbbbbb-1111-2222-3333-444444444444"
FACTS = DeviceFacts({MIG_A: GPU1, MIG_B: GPU1}, {MIG_A: "1g.10gb", MIG_B: "3g.40gb"})
KNOWN = frozenset({GPU0, GPU1, MIG_A, MIG_B})
NVIDIA = "gpu.nvidia.com"
HAMI = "hami-core-gpu.project-hami.io"
GIB = 2**30
UID = "11111111-2222-4333-8444-555555555555"


# -- reading the objects in each shape the versions serve -----------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", 80 * GIB),
        ("20480Mi", 20 * GIB),
        ("100", 100.0),
        ("30", 30.0),
        ("500m", 0.5),
        ("1e3", 1000.0),
        ("1.5G", 1.5e9),
        (4, 4.0),
        ("", None),
        ("lots", None),
        (True, None),
        (None, None),
        # beyond any device, beyond a float: not read, never an error that stops the watch
        ("1e400", None),
        ("9" * 400 + "E", None),
        ("1" + "0" * 5000, None),
        (float("inf"), None),
    ],
)
def test_quantities_read_as_numbers(text: object, value: float | None) -> None:
    assert quantity(text) == value


def _device_v1(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, **fields}


def _device_v1beta1(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "basic": fields}


GPU_ATTRS = {"type": {"string": "gpu"}, "uuid": {"string": GPU0}}
SHARED_FIELDS: dict[str, Any] = {
    "attributes": GPU_ATTRS,
    "allowMultipleAllocations": True,
    "capacity": {"memory": {"value": "80Gi"}, "gpu.nvidia.com/shares": {"value": "4"}},
}
DYN_MIG_FIELDS: dict[str, Any] = {
    "attributes": {
        "type": {"string": "mig"},
        "parentUUID": {"string": GPU1},
        "profile": {"string": "1g.10gb"},
    },
    "capacity": {"memory": {"value": "9856Mi"}, "multiprocessors": {"value": "16"}},
    "consumesCounters": [
        {"counterSet": "gpu-1-counter-set", "counters": {"memory": {"value": "9856Mi"}}}
    ],
}
SHARED = SliceDevice(
    NVIDIA,
    "node-a",
    "gpu-0",
    uuid=GPU0,
    multiple=True,
    capacity=(("memory", 80.0 * GIB), ("shares", 4.0)),
)
DYN_MIG = SliceDevice(
    NVIDIA,
    "node-a",
    "gpu-1-mig-1g10gb-0-1",
    parent_uuid=GPU1,
    profile="1g.10gb",
    capacity=(("memory", 9856.0 * 2**20), ("multiprocessors", 16.0)),
)
COUNTERS = [
    {
        "name": "gpu-1-counter-set",
        "counters": {"memory": {"value": "80Gi"}, "memory-slice-0": {"value": "1"}},
    }
]


def _slice(devices: list[dict[str, Any]] | None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"driver": NVIDIA, "pool": {"name": "node-a"}, **spec}
    if devices is not None:
        body["devices"] = devices
    return {"metadata": {"uid": "s"}, "spec": body}


@pytest.mark.parametrize(
    ("body", "devices"),
    [
        # v1 and v1beta2: a device's fields flat
        (_slice([_device_v1("gpu-0", **SHARED_FIELDS)]), (SHARED,)),
        (_slice([_device_v1("gpu-1-mig-1g10gb-0-1", **DYN_MIG_FIELDS)]), (DYN_MIG,)),
        # v1beta1: under `basic`, allowMultipleAllocations and consumesCounters too
        (_slice([_device_v1beta1("gpu-0", **SHARED_FIELDS)]), (SHARED,)),
        (_slice([_device_v1beta1("gpu-1-mig-1g10gb-0-1", **DYN_MIG_FIELDS)]), (DYN_MIG,)),
        # a slice of the pool's shared counters alone (1.37 keeps them apart from devices)
        (_slice(None, sharedCounters=COUNTERS), ()),
        (_slice([], sharedCounters=COUNTERS), ()),
        # 1.33-1.35: counters and devices in one slice
        (
            _slice([_device_v1("gpu-1-mig-1g10gb-0-1", **DYN_MIG_FIELDS)], sharedCounters=COUNTERS),
            (DYN_MIG,),
        ),
        # allowMultipleAllocations false, and a capacity that is no quantity, read as such
        (
            _slice(
                [
                    _device_v1(
                        "gpu-0",
                        attributes=GPU_ATTRS,
                        allowMultipleAllocations=False,
                        capacity={"memory": {"value": "80Gi"}, "odd": {"value": "many"}},
                    )
                ]
            ),
            (
                SliceDevice(
                    NVIDIA, "node-a", "gpu-0", uuid=GPU0, capacity=(("memory", 80.0 * GIB),)
                ),
            ),
        ),
    ],
)
def test_slices_are_read_in_each_shape(
    body: dict[str, Any], devices: tuple[SliceDevice, ...]
) -> None:
    assert slice_devices(body) == devices


def test_a_slice_of_counters_alone_leaves_the_pools_devices_found() -> None:
    """A pool's devices in one slice, its counters in another: the counters' slice adds and
    removes no device."""
    state = SliceState()
    state.apply("ADDED", {**_slice([_device_v1("gpu-1-mig-1g10gb-0-1", **DYN_MIG_FIELDS)])})
    counters = _slice(None, sharedCounters=COUNTERS)
    counters["metadata"] = {"uid": "counters"}
    state.apply("ADDED", counters)
    state.apply("DELETED", counters)
    assert state.devices == {(NVIDIA, "node-a", "gpu-1-mig-1g10gb-0-1"): DYN_MIG}


def _claim(
    name: str,
    results: list[dict[str, Any]],
    *,
    reserved: list[dict[str, str]] | None = None,
    sharing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    devices: dict[str, Any] = {
        "results": [
            {"request": "gpu", "driver": NVIDIA, "pool": "node-a", **result} for result in results
        ]
    }
    if sharing is not None:
        parameters = {"sharing": sharing}
        devices["config"] = [{"opaque": {"driver": NVIDIA, "parameters": parameters}}]
    status: dict[str, Any] = {"allocation": {"devices": devices}}
    if reserved is not None:
        status["reservedFor"] = reserved
    return {"metadata": {"uid": f"uid-{name}", "name": name, "namespace": "ml"}, "status": status}


def test_a_shared_devices_allocation_is_read_with_its_share_and_consumed_capacity() -> None:
    body = _claim(
        "c",
        [
            {
                "device": "gpu-0",
                "shareID": "8f0c9d8e-1111-4222-8333-444455556666",
                "consumedCapacity": {"gpu.nvidia.com/memory": "20Gi", "shares": "1"},
            },
            {"device": "gpu-1", "request": "gpu/mig"},
        ],
    )
    claim = claim_snapshot(body)
    assert claim is not None
    assert claim.results == (
        ClaimResult(
            NVIDIA,
            "node-a",
            "gpu-0",
            request="gpu",
            share_id="8f0c9d8e-1111-4222-8333-444455556666",
            consumed=(("memory", 20.0 * GIB), ("shares", 1.0)),
        ),
        ClaimResult(NVIDIA, "node-a", "gpu-1", request="gpu/mig"),
    )


# -- the part of a shared device a claim consumed -------------------------------------------


def _shared(*capacity: tuple[str, float], multiple: bool = True) -> SliceDevice:
    return SliceDevice(NVIDIA, "node-a", "gpu-0", GPU0, multiple=multiple, capacity=capacity)


def _result(*consumed: tuple[str, float], share_id: str | None = "s-1") -> ClaimResult:
    return ClaimResult(NVIDIA, "node-a", "gpu-0", "gpu", share_id, consumed)


MEMORY_80 = ("memory", 80.0 * GIB)


@pytest.mark.parametrize(
    ("device", "result", "part"),
    [
        # NVIDIA, consumableShares=memory: a part of the memory, no share of time said
        (_shared(MEMORY_80), _result(("memory", 20.0 * GIB)), (None, 20480)),
        # NVIDIA, consumableShares=4: one of four co-tenants; memory consumed by default 0
        (_shared(MEMORY_80, ("shares", 4)), _result(("memory", 0), ("shares", 1)), (0.25, None)),
        # NVIDIA, consumableShares=unlimited: nothing parted out
        (_shared(MEMORY_80), _result(("memory", 0)), (None, None)),
        # HAMi: a percentage of the SMs, and memory
        (
            _shared(("cores", 100), MEMORY_80),
            _result(("cores", 30), ("memory", 4.0 * GIB)),
            (0.3, 4096),
        ),
        (_shared(("cores", 100)), _result(("cores", 0)), (None, None)),  # no SM limit
        # a device shared but its capacity not published: no share of time can be said
        (_shared(), _result(("shares", 1)), (None, None)),
        # more consumed than the whole (a driver's mistake) is the whole
        (_shared(("shares", 2)), _result(("shares", 3)), (1.0, None)),
        # a device no claim shares: its capacity is the pod's, whatever the result says
        (_shared(MEMORY_80, multiple=False), _result(share_id=None), (None, None)),
        # capacities that say something else (a MIG slice's multiprocessors) are not read
        (_shared(("multiprocessors", 16)), _result(("multiprocessors", 8)), (None, None)),
    ],
)
def test_the_part_a_claim_consumed_of_a_shared_device(
    device: SliceDevice, result: ClaimResult, part: tuple[float | None, int | None]
) -> None:
    assert consumed_part(device, result) == part


# -- a world of slices and claims -----------------------------------------------------------


def _slices() -> SliceState:
    state = SliceState()
    state.apply(
        "ADDED",
        _slice(
            [
                _device_v1("gpu-0", **SHARED_FIELDS),
                _device_v1("gpu-1", attributes={"uuid": {"string": GPU1}}),
                _device_v1("gpu-1-mig-1g10gb-0-1", **DYN_MIG_FIELDS),
                _device_v1(
                    "gpu-1-mig-3g40gb-1-4",
                    attributes={
                        "uuid": {"string": MIG_B},
                        "parentUUID": {"string": GPU1},
                        "profile": {"string": "3g.40gb"},
                    },
                    consumesCounters=[
                        {"counterSet": "gpu-1-counter-set", "counters": {"memory": {"value": "1"}}}
                    ],
                ),
            ]
        ),
    )
    hami = _slice(
        [
            _device_v1(
                "hami-gpu-1",
                attributes={"uuid": {"string": GPU1}},
                allowMultipleAllocations=True,
                capacity={"cores": {"value": "100"}, "memory": {"value": "80Gi"}},
            )
        ]
    )
    hami["metadata"] = {"uid": "h"}
    hami["spec"]["driver"] = HAMI
    state.apply("ADDED", hami)
    counters = _slice(None, sharedCounters=COUNTERS)
    counters["metadata"] = {"uid": "counters"}
    state.apply("ADDED", counters)
    return state


def _dra(*claims: dict[str, Any], users: dict[str, int] | None = None) -> DraLookup:
    state = ClaimState()
    for claim in claims:
        state.apply("ADDED", claim)
    counts = users or {}
    return DraLookup(state.by_name, _slices().devices, users=lambda ns, name: counts.get(name, 1))


EXTENDED = "p-extended-resources-x2k9z"
"""The claim the scheduler made for pod p's nvidia.com/gpu."""


def _extended_claim(device: str = "gpu-1", driver: str = NVIDIA) -> dict[str, Any]:
    body = _claim(EXTENDED, [{"device": device, "request": "container-0-request-0"}])
    for result in body["status"]["allocation"]["devices"]["results"]:
        result["driver"] = driver
    body["metadata"]["annotations"] = {"resource.kubernetes.io/extended-resource-claim": "true"}
    return body


def _pod_body(
    limits: dict[str, str], *, mappings: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running"}
    if mappings is not None:
        status["extendedResourceClaimStatus"] = {
            "resourceClaimName": EXTENDED,
            "requestMappings": mappings,
        }
    return {
        "metadata": {"name": "p", "namespace": "ml", "uid": UID},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "main", "resources": {"limits": limits}}],
        },
        "status": status,
    }


GPU_MAPPING = {
    "containerName": "main",
    "resourceName": "nvidia.com/gpu",
    "requestName": "container-0-request-0",
}


def _snapshot(body: dict[str, Any], rules: AllocationRules = DEFAULT_RULES) -> PodSnapshot:
    found = snapshot_of(body, rules)
    assert found is not None
    return found


# -- KEP-5004: a GPU resource a DRA driver serves -------------------------------------------


@pytest.mark.parametrize(
    ("body", "requests", "resources", "claim", "extended"),
    [
        # served by the device plugin: a count, as ever
        (_pod_body({"nvidia.com/gpu": "1"}), 1, ("nvidia.com/gpu",), "", ()),
        # served by DRA: no device-plugin request, the scheduler's claim instead
        (
            _pod_body({"nvidia.com/gpu": "1"}, mappings=[GPU_MAPPING]),
            0,
            (),
            EXTENDED,
            ("container-0-request-0",),
        ),
        # a MIG resource from the device plugin beside a GPU from DRA
        (
            _pod_body(
                {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}, mappings=[GPU_MAPPING]
            ),
            1,
            ("nvidia.com/mig-1g.10gb",),
            EXTENDED,
            ("container-0-request-0",),
        ),
        # a DRA-served resource that is no GPU: its claim is read, its devices are no GPUs
        (
            _pod_body(
                {"example.com/nic": "1"},
                mappings=[
                    {
                        "containerName": "main",
                        "resourceName": "example.com/nic",
                        "requestName": "container-0-request-0",
                    }
                ],
            ),
            0,
            (),
            EXTENDED,
            (),
        ),
    ],
)
def test_a_gpu_resource_a_dra_driver_serves_is_the_claims_not_a_device_plugin_count(
    body: dict[str, Any],
    requests: int,
    resources: tuple[str, ...],
    claim: str,
    extended: tuple[str, ...],
) -> None:
    found = _snapshot(body)
    assert (found.gpu_requests, found.gpu_resources) == (requests, resources)
    assert (found.extended_claim, found.extended_requests) == (claim, extended)
    assert found.claims == ()
    assert found.may_hold_gpus


EXT_POD = _snapshot(_pod_body({"nvidia.com/gpu": "1"}, mappings=[GPU_MAPPING])).claimed


def _node(*devices: KubeletClaimDevice, omitted: int = 0, pod: str = "p") -> KubeletView:
    entry = KubeletPod(
        namespace="ml", name=pod, claim_devices=list(devices), omitted_claim_devices=omitted
    )
    return KubeletView({("ml", pod): entry}, KNOWN, dra=True)


def _prepared(
    claim: str, device: str, uuid: str | None, driver: str = NVIDIA
) -> KubeletClaimDevice:
    return KubeletClaimDevice(claim=claim, driver=driver, pool="node-a", device=device, uuid=uuid)


NO_VIEW = KubeletView()
HAMI_RULES = AllocationRules(dra_drivers=(NVIDIA, HAMI))


@pytest.mark.parametrize(
    ("dra", "kubelet", "used", "expected"),
    [
        # the claim read: its device is the pod's allocation, from DRA alone
        (_dra(_extended_claim()), NO_VIEW, [GPU1], (("DRA",), [GPU1], True, None)),
        (_dra(_extended_claim()), NO_VIEW, [GPU0], (("DRA",), [GPU1], True, "Unallocated")),
        # a driver not among --dra-drivers: the pod asked for GPUs, so its devices are GPUs
        (
            _dra(_extended_claim("hami-gpu-1", HAMI)),
            NO_VIEW,
            [GPU0],
            (("DRA",), [GPU1], True, "Unallocated"),
        ),
        # the claim not read (DRA unreadable, not there yet): DRA of unknown devices, never
        # unrequested
        (NO_DRA, NO_VIEW, [GPU0], (("DRA",), [], False, None)),
        (_dra(), NO_VIEW, [GPU0], (("DRA",), [], False, None)),
        # the kubelet's claim devices complete it where the API cannot
        (
            NO_DRA,
            _node(_prepared(EXTENDED, "hami-gpu-1", GPU1, HAMI)),
            [GPU0],
            (("DRA",), [GPU1], True, "Unallocated"),
        ),
        (NO_DRA, _node(_prepared(EXTENDED, "gpu-1", GPU1)), [GPU1], (("DRA",), [GPU1], True, None)),
        # ... but a device it lists without a UUID is not known by device
        (NO_DRA, _node(_prepared(EXTENDED, "gpu-1", None)), [GPU0], (("DRA",), [], False, None)),
    ],
)
def test_a_pod_whose_gpus_a_dra_driver_serves_is_judged_by_its_claims_devices(
    dra: DraLookup,
    kubelet: KubeletView,
    used: list[str],
    expected: tuple[tuple[str, ...], list[str], bool, str | None],
) -> None:
    judged = judge(EXT_POD, used, dra, DEFAULT_RULES, FACTS, kubelet=kubelet)
    allocation = judged.allocation
    found = (allocation.sources, [d.shown for d in allocation.devices], allocation.complete)
    assert (*found, judged.finding) == expected


def test_a_gpu_resource_a_dra_driver_serves_is_counted_once_for_showback() -> None:
    pod = _snapshot(_pod_body({"nvidia.com/gpu": "1"}, mappings=[GPU_MAPPING]))
    allocation = allocation_of(pod.claimed, _dra(_extended_claim()), DEFAULT_RULES)
    entry = pod_allocation(pod, allocation)
    assert entry is not None
    assert (entry.gpus, entry.mig_devices, entry.gpu_share) == (1, 0, None)
    # a device-plugin pod with the same request: the same one GPU
    plugin = _snapshot(_pod_body({"nvidia.com/gpu": "1"}))
    entry = pod_allocation(plugin, allocation_of(plugin.claimed, NO_DRA, DEFAULT_RULES))
    assert entry is not None
    assert entry.gpus == 1


# -- KEP-5075: devices several claims share -------------------------------------------------


CLAIMED = PodClaims("ml", "p", claims=("c",))


def _on(device: str, **result: Any) -> dict[str, Any]:
    return {"device": device, "shareID": f"share-{device}", **result}


@pytest.mark.parametrize(
    ("claim", "rules", "used", "expected"),
    [
        # 20Gi of the shared GPU's 80Gi: the GPU is its allocation, the 20Gi its memory
        (
            _claim("c", [_on("gpu-0", consumedCapacity={"memory": "20Gi"})]),
            DEFAULT_RULES,
            [GPU0],
            (GPU0, None, 20480, True, None),
        ),
        # one of the GPU's four shares
        (
            _claim("c", [_on("gpu-0", consumedCapacity={"shares": "1", "memory": "0"})]),
            DEFAULT_RULES,
            [GPU0],
            (GPU0, 0.25, None, True, None),
        ),
        # HAMi: 30 % of the SMs and 4Gi, on GPU1; used on GPU0: outside
        (
            {
                **_claim("c", []),
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "gpu",
                                    "driver": HAMI,
                                    "pool": "node-a",
                                    "device": "hami-gpu-1",
                                    "shareID": "s",
                                    "consumedCapacity": {"cores": "30", "memory": "4Gi"},
                                }
                            ]
                        }
                    }
                },
            },
            HAMI_RULES,
            [GPU0],
            (GPU1, 0.3, 4096, True, "Unallocated"),
        ),
    ],
)
def test_a_claim_on_a_shared_device_is_allocated_the_device_and_handed_its_part(
    claim: dict[str, Any],
    rules: AllocationRules,
    used: list[str],
    expected: tuple[str, float | None, int | None, bool, str | None],
) -> None:
    pod = PodClaims("ml", "p", claims=("c",))
    judged = judge(pod, used, _dra(claim), rules, FACTS)
    (device,) = judged.allocation.devices
    assert judged.allocation.complete
    assert (device.uuid, device.share, device.memory_mib, device.partial, judged.finding) == (
        expected
    )


def test_two_pods_sharing_a_gpu_by_capacity_are_each_handed_their_part() -> None:
    """Two claims on one shared GPU, 20Gi and 60Gi: each pod is allocated the GPU (neither is
    outside), each is handed its memory, and showback counts shares, not two GPUs."""
    dra = _dra(
        _claim("small", [_on("gpu-0", consumedCapacity={"memory": "20Gi", "shares": "1"})]),
        _claim("large", [_on("gpu-0", consumedCapacity={"memory": "60Gi", "shares": "3"})]),
    )
    handed = {}
    for name in ("small", "large"):
        pod = PodClaims("ml", name, claims=(name,))
        judged = judge(pod, [GPU0], dra, DEFAULT_RULES, FACTS)
        assert judged.finding is None
        devices = judged.allocation.devices
        handed[name] = (handed_share(devices, GPU0, ""), handed_memory(devices, GPU0))
        snapshot = PodSnapshot("ml", name, UID, "n1", claims=(name,), running=True)
        entry = pod_allocation(snapshot, judged.allocation)
        assert entry is not None
        assert entry.gpus == 0, "a part of a shared GPU is no whole GPU"
        handed[name + " showback"] = (entry.gpu_share, entry.gpu_memory_share_mib)
    assert handed == {
        "small": (0.25, 20480),
        "small showback": (0.25, 20480),
        "large": (0.75, 61440),
        "large showback": (0.75, 61440),
    }


@pytest.mark.parametrize(
    ("sharing", "users", "handed"),
    [
        (None, 1, (0.5, 40960)),
        (None, 2, (0.25, 20480)),  # no config: its part and its memory split alike
        ({"strategy": "TimeSlicing"}, 2, (0.25, 20480)),  # its part, split among its pods
        ({"strategy": "TimeSlicing"}, 1, (0.5, 40960)),
        # MPS's thread percentage is of the whole device
        ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 20}}, 2, (0.2, 20480)),
    ],
)
def test_pods_sharing_a_claim_on_a_shared_device_split_its_part(
    sharing: dict[str, Any] | None, users: int, handed: tuple[float, int]
) -> None:
    consumed = {"shares": "2", "memory": "40Gi"}
    claim = _claim("c", [_on("gpu-0", consumedCapacity=consumed)], sharing=sharing)
    allocation = allocation_of(CLAIMED, _dra(claim, users={"c": users}), DEFAULT_RULES)
    (device,) = allocation.devices
    assert (device.share, device.memory_mib) == handed


@pytest.mark.parametrize(
    ("device", "counted"),
    [
        (AllocatedDevice("claim c", GPU0, share=0.25, partial=True), (0, 0.25, None)),
        (AllocatedDevice("claim c", GPU0, memory_mib=2048, partial=True), (0, None, 2048)),
        # a part of which nothing is known: a whole GPU, as a replica of unknown count
        (AllocatedDevice("claim c", GPU0, partial=True), (1, None, None)),
        # a GPU of its own that pods share by time-slicing: as before, a GPU
        (AllocatedDevice("claim c", GPU0, share=0.5), (1, None, None)),
    ],
)
def test_showback_counts_the_part_of_a_shared_device(
    device: AllocatedDevice, counted: tuple[int, float | None, int | None]
) -> None:
    snapshot = PodSnapshot("ml", "p", UID, "n1", claims=("c",), running=True)
    entry = pod_allocation(snapshot, Allocation(("DRA",), (device,), complete=True))
    assert entry is not None
    assert (entry.gpus, entry.gpu_share, entry.gpu_memory_share_mib) == counted


# -- KEP-4815: partitionable devices, MIG created at prepare time ---------------------------


@pytest.mark.parametrize(
    ("device", "kubelet", "used", "expected"),
    [
        # a MIG device of the slice with its UUID: matched by UUID
        ("gpu-1-mig-3g40gb-1-4", NO_VIEW, [MIG_B], ([MIG_B], None)),
        ("gpu-1-mig-3g40gb-1-4", NO_VIEW, [MIG_A], ([MIG_B], "Unallocated")),
        # created at prepare time, no UUID in the slice: by parent and profile
        ("gpu-1-mig-1g10gb-0-1", NO_VIEW, [MIG_A], ([f"{GPU1}/1g.10gb"], None)),
        ("gpu-1-mig-1g10gb-0-1", NO_VIEW, [MIG_B], ([f"{GPU1}/1g.10gb"], "Unallocated")),
        # ... unless the kubelet names the MIG device the driver created: by its UUID
        (
            "gpu-1-mig-1g10gb-0-1",
            _node(_prepared("c", "gpu-1-mig-1g10gb-0-1", MIG_A)),
            [MIG_A],
            ([MIG_A], None),
        ),
    ],
)
def test_a_mig_device_of_a_partitionable_gpu_is_matched_to_the_agents(
    device: str, kubelet: KubeletView, used: list[str], expected: tuple[list[str], str | None]
) -> None:
    pod = PodClaims("ml", "p", claims=("c",))
    judged = judge(
        pod, used, _dra(_claim("c", [{"device": device}])), DEFAULT_RULES, FACTS, kubelet=kubelet
    )
    assert judged.allocation.complete
    assert ([d.shown for d in judged.allocation.devices], judged.finding) == expected


# -- KEP-5729: who uses a claim is the pods that name it ------------------------------------


def test_a_claims_users_are_the_running_pods_that_name_it_never_its_reservations() -> None:
    """The claim is reserved for a PodGroup (one entry) and for a pod that is gone; three pods
    name it, one of them no longer running, one pod of another namespace names a claim of the
    same name: two share it, each is handed half its time-sliced GPU."""
    kept = KeptPods()
    pods = [
        PodSnapshot("ml", "a", "a" * 8 + UID[8:], "n1", claims=("c",), running=True),
        PodSnapshot("ml", "b", "b" * 8 + UID[8:], "n1", running=True, extended_claim="c"),
        PodSnapshot("ml", "done", "c" * 8 + UID[8:], "n1", claims=("c",), running=False),
        PodSnapshot("other", "x", "d" * 8 + UID[8:], "n1", claims=("c",), running=True),
    ]
    for ref in pods:
        kept.put(ref)
    lookup = PodLookup(kept)
    assert lookup.claim_users("ml", "c") == 2
    reserved = [
        {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "g", "uid": "g-1"},
        {"resource": "pods", "name": "gone", "uid": "p-1"},
    ]
    claim = _claim(
        "c", [{"device": "gpu-1"}], reserved=reserved, sharing={"strategy": "TimeSlicing"}
    )
    state = ClaimState()
    state.apply("ADDED", claim)
    dra = DraLookup(state.by_name, _slices().devices, users=lookup.claim_users)
    allocation = allocation_of(pods[0].claimed, dra, DEFAULT_RULES)
    assert [(d.uuid, d.share) for d in allocation.devices] == [(GPU1, 0.5)]
    kept.put(PodSnapshot("ml", "b", "b" * 8 + UID[8:], "n1", running=False, extended_claim="c"))
    allocation = allocation_of(pods[0].claimed, dra, DEFAULT_RULES)
    assert [(d.uuid, d.share) for d in allocation.devices] == [(GPU1, None)], "alone now"


# -- the kubelet's view of a pod's claims ---------------------------------------------------


@pytest.mark.parametrize(
    ("dra", "kubelet", "used", "expected"),
    [
        # the API cannot be read: the kubelet's devices with UUIDs make the claim known
        (NO_DRA, _node(_prepared("c", "gpu-1", GPU1)), [GPU1], (("DRA",), [GPU1], True, None)),
        (
            NO_DRA,
            _node(_prepared("c", "gpu-1", GPU1)),
            [GPU0],
            (("DRA",), [GPU1], True, "Unallocated"),
        ),
        # the claim not found in the API (not in the informer yet): the same
        (
            _dra(),
            _node(_prepared("c", "gpu-1", GPU1)),
            [GPU0],
            (("DRA",), [GPU1], True, "Unallocated"),
        ),
        # nothing listed for the claim, some devices left out, the kubelet's DRA not read, a
        # GPU driver's device without its UUID: unknown, never "none"
        (NO_DRA, _node(), [GPU0], ((), [], False, None)),
        (NO_DRA, _node(_prepared("other", "gpu-1", GPU1)), [GPU0], ((), [], False, None)),
        (NO_DRA, _node(_prepared("c", "gpu-1", GPU1), omitted=1), [GPU0], ((), [], False, None)),
        (
            NO_DRA,
            KubeletView(_node(_prepared("c", "gpu-1", GPU1)).pods, KNOWN, dra=False),
            [GPU0],
            ((), [], False, None),
        ),
        (NO_DRA, _node(_prepared("c", "gpu-1", None)), [GPU0], (("DRA",), [], False, None)),
        (NO_DRA, _node(pod="q"), [GPU0], ((), [], False, None)),
        # the kubelet lists the claim's one device, a NIC: the claim is no GPU allocation
        (
            NO_DRA,
            _node(_prepared("c", "eth-1", None, driver="net.example")),
            [GPU0],
            ((), [], False, "Unrequested"),
        ),
    ],
)
def test_a_claims_devices_from_the_kubelet_where_the_api_cannot_tell(
    dra: DraLookup,
    kubelet: KubeletView,
    used: list[str],
    expected: tuple[tuple[str, ...], list[str], bool, str | None],
) -> None:
    judged = judge(CLAIMED, used, dra, DEFAULT_RULES, FACTS, kubelet=kubelet)
    allocation = judged.allocation
    found = (allocation.sources, [d.shown for d in allocation.devices], allocation.complete)
    assert (*found, judged.finding) == expected


def test_a_pod_the_kubelet_lists_for_its_claims_alone_has_no_device_plugin_allocation() -> None:
    """The kubelet lists the pod for the DRA devices it prepared, none a device plugin gave:
    it is no device-plugin allocation (whose devices would be unknown, and its findings
    withheld)."""
    kubelet = _node(_prepared("c", "gpu-1", GPU1))
    judged = judge(
        CLAIMED,
        [GPU0],
        _dra(_claim("c", [{"device": "gpu-1"}])),
        DEFAULT_RULES,
        FACTS,
        kubelet=kubelet,
    )
    assert judged.allocation.sources == ("DRA",)
    assert (judged.finding, judged.outside) == ("Unallocated", (GPU0,))


def test_a_device_the_slices_do_not_know_is_mapped_by_the_kubelets_uuid() -> None:
    claim = _claim("c", [{"device": "gpu-7"}])  # in no slice the operator has
    for kubelet, devices in (
        (NO_VIEW, []),
        (_node(_prepared("c", "gpu-7", GPU1)), [GPU1]),
    ):
        allocation = allocation_of(CLAIMED, _dra(claim), DEFAULT_RULES, kubelet)
        assert [d.shown for d in allocation.devices] == devices
        assert allocation.complete == bool(devices)


def test_the_handed_memory_sits_beside_the_used_memory_in_the_status() -> None:
    pod = PodSnapshot("ml", "p", UID, "n1", claims=("c",), running=True)
    process = Process(pid=10, used_memory_mib=30720)
    use = PodUse(pod, "n1", datetime(2026, 11, 27, tzinfo=UTC), (Resolution(GPU0, process, pod),))
    allocation = allocation_of(
        pod.claimed,
        _dra(_claim("c", [_on("gpu-0", consumedCapacity={"memory": "20Gi", "shares": "2"})])),
        DEFAULT_RULES,
    )
    (entry,) = pod_usages([use], {UID: Judgement(allocation)})
    found = (entry.used_memory_mib, entry.handed_memory_mib, entry.handed_share)
    assert found == (30720, 20480, 0.5)
    assert entry.to_patch()["handedMemoryMiB"] == 20480
