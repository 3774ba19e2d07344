"""What a pod was allocated, and the findings against its use: tables over the pure rules."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from gpuusage.api.models import (
    MAX_ALLOCATED,
    MAX_ALLOCATED_LISTED,
    DeviceReplicas,
    Gpu,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
    KubeletAllocations,
    KubeletPod,
    MigDevice,
    Process,
)
from gpuusage.api.resources import mig_profile
from gpuusage_operator.index.dra import (
    NO_DRA,
    ClaimState,
    DraLookup,
    SliceState,
    claim_snapshot,
    pod_claims,
)
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.allocation import (
    AllocatedDevice,
    Allocation,
    DeviceFacts,
    Judgement,
    KubeletView,
    allocation_of,
    claim_share,
    judge,
    replica_share,
)
from gpuusage_operator.judge.findings import REASON_UNALLOCATED
from gpuusage_operator.judge.podstate import desired_condition
from gpuusage_operator.judge.requests import (
    DEFAULT_RULES,
    AllocationRules,
    PodClaims,
    fraction_of,
    gpu_requests,
    gpu_resources,
)
from gpuusage_operator.judge.resolution import PodUse, Resolution
from gpuusage_operator.judge.status import handed_share, pod_usages
from gpuusage_operator.writers.marks import event_for

GPU0 = "GPU-00000000-1111-2222-3333-444444444444"
GPU1 = "GPU-11111111-1111-2222-3333-444444444444"
MIG_A = "MIG-aaaaaaaa-1111-2222-3333-444444444444"
MIG_B = "MIG-bbbbbbbb-1111-2222-3333-444444444444"
FACTS = DeviceFacts({MIG_A: GPU1, MIG_B: GPU1}, {MIG_A: "3g.40gb", MIG_B: "1g.10gb"})


def _slice(uid: str, devices: list[dict[str, str]], driver: str = "gpu.nvidia.com") -> Any:
    return {
        "metadata": {"uid": uid},
        "spec": {
            "driver": driver,
            "pool": {"name": "node-a"},
            "devices": [
                {
                    "name": d["name"],
                    "attributes": {k: {"string": v} for k, v in d.items() if k != "name"},
                }
                for d in devices
            ],
        },
    }


def _claim(name: str, devices: list[str], driver: str = "gpu.nvidia.com") -> Any:
    results = [{"request": "gpu", "driver": driver, "pool": "node-a", "device": d} for d in devices]
    return {
        "metadata": {"uid": f"uid-{name}", "name": name, "namespace": "ml"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def _dra(*claims: Any) -> DraLookup:
    slices, state = SliceState(), ClaimState()
    slices.apply(
        "ADDED",
        _slice(
            "s1",
            [
                {"name": "gpu-0", "type": "gpu", "uuid": GPU0},
                {"name": "gpu-1", "type": "gpu", "uuid": GPU1},
                {"name": "gpu-1-mig-3g", "type": "mig", "uuid": MIG_A, "parentUUID": GPU1},
                # created at prepare time: no uuid yet
                {
                    "name": "gpu-1-mig-1g-dyn",
                    "type": "mig",
                    "parentUUID": GPU1,
                    "profile": "1g.10gb",
                },
            ],
        ),
    )
    slices.apply("ADDED", _slice("s2", [{"name": "nic-0", "uuid": "nic"}], driver="net.example"))
    for claim in claims:
        state.apply("ADDED", claim)
    return DraLookup(state.by_name, slices.devices)


def _pod(**kwargs: Any) -> PodClaims:
    return PodClaims(namespace="ml", **kwargs)


def _got(devices: list[str]) -> DraLookup:
    """Claim "c" allocated these devices."""
    return _dra(_claim("c", devices))


CLAIMED = _pod(claims=("c",))
NIC = _dra(_claim("n", ["nic-0"], "net.example"))


@pytest.mark.parametrize(
    ("pod", "dra", "used", "finding", "outside"),
    [
        # device plugin: a count; its devices are not known, so no device is "outside"
        (_pod(gpu_requests=1), NO_DRA, [GPU0, GPU1], None, ()),
        # a scheduler's share: a GPU allocation of unknown device
        (_pod(fraction="gpu-fraction=0.5"), NO_DRA, [GPU1], None, ()),
        # nothing at all
        (_pod(), NO_DRA, [GPU0], "Unrequested", (GPU0,)),
        # claims that cannot be read: never unrequested
        (_pod(claims=("gpu",)), NO_DRA, [GPU0], None, ()),
        (_pod(claims=("missing",)), _dra(), [GPU0], None, ()),
        (_pod(pending_claims=1), _dra(), [GPU0], None, ()),
        # DRA, full GPUs
        (CLAIMED, _got(["gpu-0"]), [GPU0], None, ()),
        (CLAIMED, _got(["gpu-0"]), [GPU0, GPU1], "Unallocated", (GPU1,)),
        # a whole GPU covers its MIG devices; a MIG device does not cover its GPU
        (CLAIMED, _got(["gpu-1"]), [MIG_A], None, ()),
        (CLAIMED, _got(["gpu-1-mig-3g"]), [GPU1], "Unallocated", (GPU1,)),
        (CLAIMED, _got(["gpu-1-mig-3g"]), [MIG_A], None, ()),
        (
            _pod(claims=("c",)),
            _dra(_claim("c", ["gpu-1-mig-3g"])),
            [MIG_B],
            "Unallocated",
            (MIG_B,),
        ),
        # dynamic MIG: matched by parent GPU and profile
        (CLAIMED, _got(["gpu-1-mig-1g-dyn"]), [MIG_B], None, ()),
        (
            _pod(claims=("c",)),
            _dra(_claim("c", ["gpu-1-mig-1g-dyn"])),
            [MIG_A],
            "Unallocated",
            (MIG_A,),
        ),
        # a claim of another driver is no GPU allocation
        (
            _pod(claims=("n",)),
            _dra(_claim("n", ["nic-0"], "net.example")),
            [GPU0],
            "Unrequested",
            (GPU0,),
        ),
        # a device the slices do not describe: the allocation is not known device by device
        (CLAIMED, _got(["gpu-9"]), [GPU0], None, ()),
        # device plugin and DRA together: only a count is known of the whole
        (_pod(gpu_requests=1, claims=("c",)), _dra(_claim("c", ["gpu-0"])), [GPU1], None, ()),
    ],
)
def test_findings(
    pod: PodClaims, dra: DraLookup, used: list[str], finding: str | None, outside: tuple[str, ...]
) -> None:
    judged = judge(pod, used, dra, DEFAULT_RULES, FACTS)
    assert (judged.finding, judged.outside) == (finding, outside)


def test_allocation_says_how_and_what() -> None:
    dra = _dra(_claim("c", ["gpu-0", "gpu-1-mig-1g-dyn"]))
    allocation = allocation_of(_pod(claims=("c",)), dra, DEFAULT_RULES)
    assert allocation.sources == ("DRA",)
    assert [(d.shown, d.match) for d in allocation.devices] == [
        (GPU0, "UUID"),
        (f"{GPU1}/1g.10gb", "ParentAndProfile"),
    ]
    assert allocation.complete
    both = allocation_of(_pod(gpu_requests=2, fraction="gpu-memory=4096"), NO_DRA, DEFAULT_RULES)
    assert both.sources == ("DevicePlugin", "Fractional")
    assert not both.complete
    assert both.detail == "2 GPUs (device plugin); a share (gpu-memory=4096)"


def test_configured_names_count() -> None:
    spec = {"containers": [{"resources": {"limits": {"example.com/vgpu": "2", "cpu": "1"}}}]}
    assert gpu_requests(spec) == 0
    rules = AllocationRules(extra_resources=("example.com/vgpu",))
    assert gpu_requests(spec, rules) == 2
    annotations = {"gpu-fraction": "0.5", "other": "x"}
    assert fraction_of(annotations) == "gpu-fraction=0.5"
    assert fraction_of(annotations, AllocationRules(fraction_annotations=("share",))) == ""
    dra = _dra(_claim("n", ["nic-0"], "net.example"))
    nic = allocation_of(_pod(claims=("n",)), dra, AllocationRules(dra_drivers=("net.example",)))
    assert nic.sources == ("DRA",)


def test_pod_claims_from_spec_and_status() -> None:
    pod = {
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared-gpu"},
                {"name": "b", "resourceClaimTemplateName": "gpu-template"},
                {"name": "c", "resourceClaimTemplateName": "gpu-template"},
            ]
        },
        "status": {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "pod-b-x1y2"}]},
    }
    assert pod_claims(pod) == (("shared-gpu", "pod-b-x1y2"), 1)
    assert pod_claims({}) == ((), 0)


def test_slice_and_claim_states_follow_their_objects() -> None:
    slices = SliceState()
    slices.apply("ADDED", _slice("s1", [{"name": "gpu-0", "uuid": GPU0}]))
    slices.apply("MODIFIED", _slice("s1", [{"name": "gpu-0", "uuid": GPU1}]))
    assert slices.devices[("gpu.nvidia.com", "node-a", "gpu-0")].uuid == GPU1
    slices.apply("DELETED", _slice("s1", []))
    assert not slices.devices
    assert len(slices) == 0
    claims = ClaimState()
    claims.apply("ADDED", _claim("c", ["gpu-0"]))
    assert claims.by_name[("ml", "c")].results[0].device == "gpu-0"
    claims.apply("DELETED", _claim("c", []))
    assert claims.ids() == set()


def test_mig_profile_from_the_product_name() -> None:
    assert mig_profile("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert mig_profile("NVIDIA H100 80GB HBM3 MIG 3g.40gb") == "3g.40gb"
    assert mig_profile("NVIDIA A100-SXM4-40GB") is None
    assert mig_profile(None) is None


def test_unallocated_use_is_a_warning_with_its_own_reason() -> None:

    pod = PodSnapshot("ml", "p", "11111111-2222-4333-8444-555555555555", "node-a", claims=("c",))
    use = PodUse(
        pod, "node-a", datetime(2026, 1, 1, tzinfo=UTC), (Resolution(GPU1, Process(pid=1), pod),)
    )
    judged = judge(pod.claimed, use.devices, _dra(_claim("c", ["gpu-0"])), DEFAULT_RULES, FACTS)
    condition = desired_condition("InUse", use, "node-a", judgement=judged)
    assert condition["reason"] == REASON_UNALLOCATED
    assert GPU1 in condition["message"]
    assert "claim c" in condition["message"]
    started = event_for(None, condition)
    assert started is not None
    assert (started.reason, started.type) == (REASON_UNALLOCATED, "Warning")
    running = {**condition, "reason": "ProcessesRunning"}
    later = event_for(running, condition)
    assert later is not None
    assert (later.reason, later.note) == (REASON_UNALLOCATED, "uses a GPU outside its allocation")
    assert event_for(condition, condition) is None, "not once per report"
    fine = judge(pod.claimed, use.devices, _dra(_claim("c", ["gpu-1"])), DEFAULT_RULES, FACTS)
    assert desired_condition("InUse", use, "node-a", judgement=fine)["reason"] == "ProcessesRunning"


def test_status_entries_carry_the_allocation_and_one_finding_each() -> None:
    claimed = PodSnapshot(
        "ml", "p", "11111111-2222-4333-8444-555555555555", "node-a", claims=("c",)
    )
    rogue = PodSnapshot("ml", "r", "22222222-2222-4333-8444-555555555555", "node-a")
    when = datetime(2026, 1, 1, tzinfo=UTC)
    uses = {
        pod.uid: PodUse(pod, "node-a", when, (Resolution(GPU1, Process(pid=n), pod),))
        for n, pod in enumerate((claimed, rogue), start=1)
    }
    dra = _got(["gpu-0"])
    judged = {
        uid: judge(u.pod.claimed, u.devices, dra, DEFAULT_RULES, FACTS) for uid, u in uses.items()
    }
    by_name = {u.name: u for u in pod_usages(uses.values(), judged)}
    assert (by_name["p"].unallocated, by_name["p"].unrequested) == (True, False)
    assert by_name["p"].allocated_by == ["DRA"]
    assert by_name["p"].allocated_devices == [GPU0]
    assert (by_name["r"].unallocated, by_name["r"].unrequested) == (False, True)
    assert by_name["r"].allocated_by == []


GPU2 = "GPU-22222222-1111-2222-3333-444444444444"
KNOWN = frozenset({GPU0, GPU1, MIG_A, MIG_B})
PLUGIN = _pod(name="p", gpu_requests=1, resources=("nvidia.com/gpu",))


def _kubelet(*entries: KubeletPod, known: frozenset[str] = KNOWN) -> KubeletView:
    return KubeletView({(e.namespace, e.name): e for e in entries}, known)


def _entry(
    *devices: str, resources: tuple[str, ...] = ("nvidia.com/gpu",), other: int = 0
) -> KubeletPod:
    return KubeletPod(
        namespace="ml",
        name="p",
        resources=list(resources),
        devices=list(devices),
        other_devices=other,
    )


@pytest.mark.parametrize(
    ("pod", "kubelet", "dra", "used", "expected"),
    [
        # the kubelet's devices make a device-plugin allocation known device by device
        (PLUGIN, _kubelet(_entry(GPU0)), NO_DRA, [GPU0], (None, ())),
        (PLUGIN, _kubelet(_entry(GPU0)), NO_DRA, [GPU0, GPU1], ("Unallocated", (GPU1,))),
        (PLUGIN, _kubelet(_entry(GPU1)), NO_DRA, [MIG_A], (None, ())),
        (PLUGIN, _kubelet(_entry(MIG_A)), NO_DRA, [MIG_B], ("Unallocated", (MIG_B,))),
        # not known one by one: nothing judged by device
        (PLUGIN, _kubelet(), NO_DRA, [GPU1], (None, ())),  # the kubelet does not list the pod
        (PLUGIN, _kubelet(_entry(GPU2)), NO_DRA, [GPU1], (None, ())),  # not a device of the report
        (PLUGIN, _kubelet(_entry(GPU0, other=1)), NO_DRA, [GPU1], (None, ())),  # a plugin's own ID
        (PLUGIN, _kubelet(_entry()), NO_DRA, [GPU1], (None, ())),  # listed without devices
        (  # a requested GPU resource the agent did not report devices for
            _pod(name="p", gpu_requests=2, resources=("example.com/vgpu", "nvidia.com/gpu")),
            _kubelet(_entry(GPU0)),
            NO_DRA,
            [GPU1],
            (None, ()),
        ),
        (  # a scheduler's share is never known by device
            _pod(
                name="p", gpu_requests=1, resources=("nvidia.com/gpu",), fraction="gpu-fraction=0.5"
            ),
            _kubelet(_entry(GPU0)),
            NO_DRA,
            [GPU1],
            (None, ()),
        ),
        # listed by the kubelet with GPUs the operator does not count: allocated, never rogue,
        # and not judged by device (its request is not known to be covered)
        (
            _pod(name="p"),
            _kubelet(_entry(GPU0, resources=("vendor.example/gpu",))),
            NO_DRA,
            [GPU1],
            (None, ()),
        ),
        # device plugin and DRA, each known: the union is the allocation
        (
            _pod(name="p", gpu_requests=1, resources=("nvidia.com/gpu",), claims=("c",)),
            _kubelet(_entry(GPU0)),
            _got(["gpu-1"]),
            [GPU0, MIG_A],
            (None, ()),
        ),
        (
            _pod(name="p", gpu_requests=1, resources=("nvidia.com/gpu",), claims=("c",)),
            _kubelet(_entry(GPU0)),
            _got(["gpu-1-mig-3g"]),
            [GPU0, MIG_B],
            ("Unallocated", (MIG_B,)),
        ),
    ],
)
def test_findings_with_the_kubelets_devices(
    pod: PodClaims,
    kubelet: KubeletView,
    dra: DraLookup,
    used: list[str],
    expected: tuple[str | None, tuple[str, ...]],
) -> None:
    judged = judge(pod, used, dra, DEFAULT_RULES, FACTS, kubelet=kubelet)
    assert (judged.finding, judged.outside) == expected
    assert judged.allocation.sources[0] == "DevicePlugin"


def test_the_kubelet_view_reads_only_a_read_section() -> None:
    gpus = [Gpu(index=0, uuid=GPU0, mig_devices=[MigDevice(index=0, uuid=MIG_A)])]
    when = datetime(2026, 1, 1, tzinfo=UTC)
    read = KubeletAllocations(state="Read", pods=[_entry(GPU0)])
    view = KubeletView.of(
        GpuNodeUsageSpec(node_name="n", observed_at=when, gpus=gpus, kubelet=read)
    )
    assert view.known == {GPU0, MIG_A}
    assert view.pods[("ml", "p")].devices == [GPU0]
    down = KubeletAllocations(state="Unavailable", message="restarting")
    for section in (down, None):
        spec = GpuNodeUsageSpec(node_name="n", observed_at=when, gpus=gpus, kubelet=section)
        assert KubeletView.of(spec) == KubeletView()


def test_a_pod_given_time_slicing_replicas_is_handed_their_part_of_the_gpu() -> None:
    """GPU0 advertised as 4 replicas: a pod given 1 was handed a quarter of its time, one given
    2 a half; its own GPU1 (no replicas) no share; replicas the node cannot count, none."""
    gpus = [Gpu(index=0, uuid=GPU0), Gpu(index=1, uuid=GPU1)]
    when = datetime(2026, 1, 1, tzinfo=UTC)

    def handed(given: int, replicated: list[DeviceReplicas]) -> dict[str, float | None]:
        entry = _entry(GPU0, GPU1).model_copy(
            update={"replicas": [DeviceReplicas(device=GPU0, replicas=given)]}
        )
        section = KubeletAllocations(state="Read", pods=[entry], replicated=replicated)
        view = KubeletView.of(
            GpuNodeUsageSpec(node_name="n", observed_at=when, gpus=gpus, kubelet=section)
        )
        judged = judge(PLUGIN, [GPU0], NO_DRA, DEFAULT_RULES, FACTS, kubelet=view)
        devices = judged.allocation.devices
        return {d: handed_share(devices, d, "") for d in (GPU0, GPU1)}

    four = [DeviceReplicas(device=GPU0, replicas=4)]
    assert handed(1, four) == {GPU0: 0.25, GPU1: None}
    assert handed(2, four) == {GPU0: 0.5, GPU1: None}
    assert handed(1, []) == {GPU0: None, GPU1: None}, "the replicas are not known"
    assert replica_share(5, 4) == 1.0, "never more than the GPU"


def test_requested_resource_names_from_the_spec() -> None:
    spec = {
        "initContainers": [{"resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}],
        "containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "2"}}},
            {"resources": {"requests": {"example.com/vgpu": "1"}}},
        ],
    }
    assert gpu_resources(spec) == ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")
    rules = AllocationRules(extra_resources=("example.com/vgpu",))
    assert gpu_resources(spec, rules) == (
        "example.com/vgpu",
        "nvidia.com/gpu",
        "nvidia.com/mig-1g.10gb",
    )
    shared = {"containers": [{"resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}]}
    assert gpu_resources(shared) == ("nvidia.com/gpu.shared",), "NVIDIA's renamed replicas"
    assert gpu_requests(shared) == 1


def test_allocated_devices_are_listed_within_the_status_budget() -> None:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    many = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(MAX_ALLOCATED + 4)]
    pods = [
        PodSnapshot("ml", f"p{n:03d}", f"{n:08x}-2222-4333-8444-555555555555", "node-a")
        for n in range(MAX_ALLOCATED_LISTED // MAX_ALLOCATED + 2)
    ]
    uses = {p.uid: PodUse(p, "node-a", when, (Resolution(GPU1, Process(pid=1), p),)) for p in pods}
    allocation = Allocation(
        ("DevicePlugin",), tuple(AllocatedDevice("kubelet", d) for d in many), True
    )
    judged = {uid: Judgement(allocation) for uid in uses}
    entries = pod_usages(uses.values(), judged)
    listed = [len(e.allocated_devices) for e in entries]
    assert sum(listed) == MAX_ALLOCATED_LISTED
    assert listed[0] == MAX_ALLOCATED
    assert entries[0].allocated_devices_omitted == 4
    assert (listed[-1], entries[-1].allocated_devices_omitted) == (0, len(many))
    GpuNodeUsageStatus(pods=entries)  # the model's own bound holds


def _shared_claim(sharing: dict[str, Any] | None, pods: int, *, in_status: bool = True) -> Any:
    config = [{"opaque": {"driver": "gpu.nvidia.com", "parameters": {"sharing": sharing}}}]
    devices: dict[str, Any] = {"results": [], **({"config": config} if in_status else {})}
    return {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
        "spec": {"devices": {} if in_status else {"config": config}},
        "status": {
            "allocation": {"devices": devices},
            "reservedFor": [{"resource": "pods", "name": f"p{i}"} for i in range(pods)],
        },
    }


@pytest.mark.parametrize(
    ("sharing", "pods", "in_status", "share"),
    [
        ({"strategy": "TimeSlicing"}, 2, True, 0.5),
        ({"strategy": "TimeSlicing"}, 4, False, 0.25),
        ({"strategy": "TimeSlicing"}, 1, True, None),
        ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}, 1, True, 0.3),
        ({"strategy": "MPS"}, 3, True, 1 / 3),
        ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 300}}, 2, True, 0.5),
        ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": True}}, 2, True, 0.5),
        ({"strategy": "Exclusive"}, 2, True, None),
        (None, 2, True, None),
    ],
)
def test_a_claim_hands_each_pod_its_part_of_a_shared_device(
    sharing: dict[str, Any] | None, pods: int, in_status: bool, share: float | None
) -> None:
    """NVIDIA's GpuConfig `sharing`, from the allocation's device config (or the claim's own):
    MPS's active thread percentage where valid, else an equal part for each running pod that
    names the claim; nothing for a claim one pod has alone or that shares nothing. The claim's
    `reservedFor` is not who uses it (it may name a PodGroup): it lists one entry here whatever
    the pods."""
    claim = claim_snapshot(_shared_claim(sharing, 1, in_status=in_status))
    assert claim is not None
    found = claim_share(claim, pods)
    assert found == (pytest.approx(share) if share is not None else None)


def test_the_handed_share_of_a_device_comes_from_its_claim_else_the_fraction() -> None:
    gpu = "GPU-11111111-2222-3333-4444-555555555555"
    claimed = [AllocatedDevice("claim c", gpu, share=0.5), AllocatedDevice("claim d", "GPU-x")]
    assert handed_share(claimed, gpu, "gpu-fraction=0.25") == 0.5, "the claim's, on its device"
    assert handed_share(claimed, "GPU-x", "gpu-fraction=0.25") == 0.25, "no share on that one"
    assert handed_share([], gpu, "gpu-fraction=2") is None, "two GPUs are no share of one"
    assert handed_share([], gpu, "") is None
