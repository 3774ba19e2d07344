"""Use judged against what the cluster handed out, on the real control plane: DRA claims and
slices written as NVIDIA's driver and the scheduler write them, a claim from a template, a
scheduler's share in annotations, a configured resource name, and a pod with no allocation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage_dev.fakekubelet import FakeKubelet
from gpuusage_dev.simulation import create_allocated_claim, create_gpu_slice
from tests.conftest import GPU0, GPU1, WorldFactory, wait_for
from tests.fakenvml import gpu_uuid, mig_uuid
from tests.simworld import SimWorld
from tests.worldview import condition, events, pod, report

pytestmark = pytest.mark.cluster


def _entries(world: SimWorld, name: str) -> list[dict[str, Any]]:
    return [p for p in report(world).get("status", {}).get("pods", []) if p["name"] == name]


def _reason(world: SimWorld, name: str) -> str:
    found = condition(pod(world, name))
    return f"{found.status} {found.reason}"


def test_dra_pods_are_judged_by_the_devices_their_claims_got(make_world: WorldFactory) -> None:
    """train's claim got GPU0, which it uses; the notebook's claim (from a template) got GPU0
    too, but it runs on GPU1: UsingUnallocatedGPU, with a Warning Event."""
    world = make_world(
        {"train": 0, "notebook": 0},
        pod_extras={
            "train": {"claims": {"gpu": "train-gpu"}},
            "notebook": {"templates": {"gpu": "notebook-gpu-x7k2q"}},
        },
    )
    resource = client.ResourceV1Api(world.api)
    node = world.node
    create_gpu_slice(
        resource,
        node,
        [
            {"name": "gpu-0", "type": "gpu", "uuid": GPU0},
            {"name": "gpu-1", "type": "gpu", "uuid": GPU1},
        ],
    )
    create_allocated_claim(resource, world.ns, "train-gpu", node, ["gpu-0"])
    create_allocated_claim(resource, world.ns, "notebook-gpu-x7k2q", node, ["gpu-0"])

    wait_for(lambda: _reason(world, "notebook") == "True UsingUnallocatedGPU", what="unallocated")
    wait_for(lambda: _reason(world, "train") == "True ProcessesRunning", what="train inside")
    message = condition(pod(world, "notebook")).message or ""
    assert GPU1 in message
    assert "claim notebook-gpu-x7k2q" in message
    wait_for(lambda: "UsingUnallocatedGPU" in events(world, "notebook"), what="Warning Event")
    warning = [
        e
        for e in client.EventsV1Api(world.api).list_namespaced_event(world.ns).items
        if e.reason == "UsingUnallocatedGPU"
    ]
    assert [e.type for e in warning] == ["Warning"]
    # the status is written after the pods in the same reconcile
    wait_for(lambda: report(world)["status"]["totals"]["unallocatedPods"] == 1, what="totals")
    (train,) = _entries(world, "train")
    assert (train["allocatedBy"], train["allocatedDevices"]) == (["DRA"], [GPU0])
    assert not train.get("unallocated")
    assert not train.get("unrequested")
    (notebook,) = _entries(world, "notebook")
    assert (notebook["deviceUUID"], notebook["unallocated"]) == (GPU1, True)

    # The scheduler's answer changes (the claim is recreated on GPU1): the finding goes.
    resource.delete_namespaced_resource_claim("notebook-gpu-x7k2q", world.ns)
    create_allocated_claim(resource, world.ns, "notebook-gpu-x7k2q", node, ["gpu-1"])
    wait_for(lambda: _reason(world, "notebook") == "True ProcessesRunning", what="inside again")
    wait_for(
        lambda: report(world)["status"]["totals"].get("unallocatedPods", 0) == 0, what="totals"
    )


def test_every_allocation_source_counts_and_no_allocation_is_still_flagged(
    make_world: WorldFactory,
) -> None:
    """A scheduler's share (annotation), a configured resource name and a claim the operator
    cannot see yet are allocations (never UsingUnrequestedGPU); a pod with none is flagged."""
    world = make_world(
        {"train": 0, "notebook": 0, "rogue": 0, "vgpu": 0},
        pod_extras={
            "train": {"annotations": {"gpu-fraction": "0.5"}},
            "notebook": {"claims": {"gpu": "not-created-yet"}},
            "vgpu": {"resources": {"example.com/vgpu": "1"}},
        },
        operator_extras={"gpu_resources": "example.com/vgpu"},
    )
    gpus = [
        {"pid": 4242, "usedMemoryMiB": 1024},
        {"pid": world.pids["rogue"], "usedMemoryMiB": 2048},
        {"pid": world.pids["vgpu"], "usedMemoryMiB": 512},
    ]
    world.scenario(
        [
            {"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": gpus},
            {
                "index": 1,
                "uuid": GPU1,
                "memoryTotalMiB": 81920,
                "processes": [{"pid": 5151, "usedMemoryMiB": 4096}],
            },
        ]
    )
    wait_for(lambda: _reason(world, "rogue") == "True UsingUnrequestedGPU", what="rogue flagged")
    for name in ("train", "notebook", "vgpu"):

        def running(n: str = name) -> bool:
            return _reason(world, n) == "True ProcessesRunning"

        wait_for(running, what=f"{name} in use")
    # the status is written after the pods in the same reconcile
    wait_for(lambda: report(world)["status"]["totals"]["unrequestedPods"] == 1, what="totals")
    assert _entries(world, "train")[0]["allocatedBy"] == ["Fractional"]
    assert _entries(world, "vgpu")[0]["allocatedBy"] == ["DevicePlugin"]
    notebook = _entries(world, "notebook")[0]
    assert notebook.get("allocatedBy", []) == []
    assert not notebook.get("unrequested")
    assert "UsingUnrequestedGPU" not in events(world, "notebook") + events(world, "train")


def test_device_plugin_pods_are_judged_by_the_devices_the_kubelet_gave_them(
    make_world: WorldFactory, tmp_path: Path
) -> None:
    """The kubelet (the fake one, speaking PodResources v1) gave train GPU1 and the notebook
    GPU1 through one of its 4 time-slicing replicas (GetAllocatableResources lists the 4); train
    runs on GPU0: UsingUnallocatedGPU; the notebook was handed a quarter of GPU1. While the
    kubelet cannot be read, nothing is judged by device, and the finding is not kept."""
    kubelet = FakeKubelet(tmp_path / "pod-resources" / "kubelet.sock")
    given = {"train": [GPU1], "notebook": [f"{GPU1}::2"]}

    def answer(ns: str) -> None:
        kubelet.pods(
            *(
                {
                    "name": name,
                    "namespace": ns,
                    "containers": [
                        {
                            "name": "c",
                            "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ids}],
                        }
                    ],
                }
                for name, ids in given.items()
            ),
            advertised={"nvidia.com/gpu": [GPU0, *(f"{GPU1}::{n}" for n in range(4))]},
        )

    kubelet.pods()
    with kubelet:
        world = make_world(
            agent_extras={"pod_resources_socket": kubelet.socket, "pod_resources_refresh": 0.2}
        )
        answer(world.ns)
        wait_for(lambda: _reason(world, "train") == "True UsingUnallocatedGPU", what="unallocated")
        wait_for(lambda: _reason(world, "notebook") == "True ProcessesRunning", what="notebook")
        spec = report(world)["spec"]["kubelet"]
        assert spec["state"] == "Read"
        assert {p["name"]: p["devices"] for p in spec["pods"]} == {
            "train": [GPU1],
            "notebook": [GPU1],
        }
        assert spec["replicated"] == [{"device": GPU1, "replicas": 4}]
        assert {p["name"]: p.get("replicas") for p in spec["pods"]} == {
            "train": None,
            "notebook": [{"device": GPU1, "replicas": 1}],
        }
        wait_for(lambda: _entries(world, "notebook")[0].get("handedShare"), what="handed share")
        (notebook,) = _entries(world, "notebook")
        assert (notebook["deviceUUID"], notebook["handedShare"]) == (GPU1, 0.25)
        handed = {a["name"]: a for a in report(world)["status"]["allocations"]}
        # for showback, its replica is the quarter of a GPU it stands for, not a whole GPU
        assert (handed["notebook"].get("gpus", 0), handed["notebook"]["gpuShare"]) == (0, 0.25)
        assert (handed["train"]["gpus"], handed["train"].get("gpuShare")) == (1, None)
        # the status is written after the pods in the same reconcile
        wait_for(lambda: _entries(world, "train")[0].get("unallocated"), what="status")
        (train,) = _entries(world, "train")
        assert (train["allocatedBy"], train["allocatedDevices"]) == (["DevicePlugin"], [GPU1])
        assert (train["deviceUUID"], train["unallocated"]) == (GPU0, True)
        assert GPU0 in (condition(pod(world, "train")).message or "")
        wait_for(lambda: "UsingUnallocatedGPU" in events(world, "train"), what="Warning Event")

        kubelet.answer({"error": {"code": 14, "message": "kubelet restarting"}})
        wait_for(lambda: _reason(world, "train") == "True ProcessesRunning", what="not judged")
        down = report(world)["spec"]["kubelet"]
        assert down["state"] == "Unavailable"
        assert "kubelet restarting" in down["message"]
        # the status is written after the pods in the same reconcile
        wait_for(lambda: not _entries(world, "train")[0].get("unallocated"), what="status")
        (train,) = _entries(world, "train")
        assert train.get("allocatedDevices", []) == []


def test_device_ids_by_index_or_device_node_are_mapped_to_uuids(
    make_world: WorldFactory, tmp_path: Path
) -> None:
    """NVIDIA's plugin with deviceIDStrategy=index names GPU 1 "1"; GKE's names it by its
    device node, "nvidia1": both are GPU1 to the operator, so train, running on GPU0, is still
    caught outside its allocation (it was left unjudged when such IDs were only counted)."""
    kubelet = FakeKubelet(tmp_path / "pod-resources" / "kubelet.sock")
    kubelet.pods()
    with kubelet:
        world = make_world(
            agent_extras={"pod_resources_socket": kubelet.socket, "pod_resources_refresh": 0.2}
        )
        world.scenario(
            [
                {
                    "index": 0,
                    "uuid": GPU0,
                    "minorNumber": 0,
                    "memoryTotalMiB": 81920,
                    "processes": [{"pid": 4242, "usedMemoryMiB": 30720}],
                },
                {
                    "index": 1,
                    "uuid": GPU1,
                    "minorNumber": 1,
                    "memoryTotalMiB": 81920,
                    "processes": [{"pid": 5151, "usedMemoryMiB": 10240}],
                },
            ]
        )
        kubelet.pods(
            *(
                {
                    "name": name,
                    "namespace": world.ns,
                    "containers": [
                        {
                            "name": "c",
                            "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": [dev]}],
                        }
                    ],
                }
                for name, dev in (("train", "1"), ("notebook", "nvidia1"))
            )
        )
        wait_for(lambda: _reason(world, "train") == "True UsingUnallocatedGPU", what="unallocated")
        wait_for(lambda: _reason(world, "notebook") == "True ProcessesRunning", what="notebook")

        def given() -> dict[str, tuple[list[str], int]]:
            listed = report(world)["spec"]["kubelet"]["pods"]
            return {p["name"]: (p.get("devices", []), p.get("otherDevices", 0)) for p in listed}

        # the minor numbers arrive with the scenario's next reading: wait for them
        wait_for(lambda: given() == {"train": ([GPU1], 0), "notebook": ([GPU1], 0)}, what="IDs")


def test_pods_given_gpus_by_a_claim_or_a_share_are_idle_when_they_use_none(
    make_world: WorldFactory,
) -> None:
    """Requested-but-idle counts every allocation: a pod whose claim got a GPU and a pod with a
    scheduler's share, neither running anything, are flagged; a pod whose only claim is a
    network device is not a GPU holder, and is left alone."""
    world = make_world(
        {"train": 1, "notebook": 1, "claimed": 0, "nic": 0, "shared": 0},
        idle_after=1.0,
        pod_extras={
            "claimed": {"claims": {"gpu": "claimed-gpu"}},
            "nic": {"claims": {"net": "nic-claim"}},
            "shared": {"annotations": {"gpu-fraction": "0.25"}},
        },
    )
    resource = client.ResourceV1Api(world.api)
    create_gpu_slice(resource, world.node, [{"name": "gpu-0", "type": "gpu", "uuid": GPU0}])
    create_allocated_claim(resource, world.ns, "claimed-gpu", world.node, ["gpu-0"])
    create_allocated_claim(
        resource, world.ns, "nic-claim", world.node, ["eth-1"], driver="net.example"
    )
    for name in ("claimed", "shared"):

        def idle(n: str = name) -> bool:
            return _reason(world, n) == "False RequestedGPUsIdle"

        wait_for(idle, what=f"{name} idle")
    message = condition(pod(world, "claimed")).message or ""
    assert "was given claim claimed-gpu; devices " + GPU0 in message
    assert "a share (gpu-fraction=0.25)" in (condition(pod(world, "shared")).message or "")
    wait_for(
        lambda: (
            {p["name"]: p.get("requestedGPUs", 0) for p in report(world)["status"]["idlePods"]}
            == {"claimed": 1, "shared": 0}
        ),
        what="the idle pods in the status",
    )
    counts = world.reconciler.counts
    seen = counts.reconciles
    wait_for(lambda: counts.reconciles >= seen + 5, what="more reconciles")
    with pytest.raises(StopIteration):
        condition(pod(world, "nic"))


def test_mig_claims_by_uuid_and_dynamic_mig_by_parent_and_profile(
    make_world: WorldFactory,
) -> None:
    """A slice as NVIDIA's driver publishes MIG devices (device names without dots: the
    apiserver refuses them): one with its UUID, one created at prepare time (no UUID, only its
    parent GPU and profile). A pod on the MIG device its claim
    named, a pod on a dynamic device matched by parent and profile, and a pod whose claim got
    the dynamic 1g device but that runs on the 3g one."""
    world = make_world(
        {"mig": 0, "dyn": 0, "wrong": 0},
        pod_extras={
            "mig": {"claims": {"gpu": "mig-3g"}},
            "dyn": {"templates": {"gpu": "dyn-1g-x2k9z"}},
            "wrong": {"claims": {"gpu": "wrong-1g"}},
        },
    )
    pids = world.pids
    mig_3g, mig_1g = mig_uuid(3), mig_uuid(1)
    world.scenario(
        [
            {"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []},
            {
                "index": 1,
                "uuid": GPU1,
                "memoryTotalMiB": 81920,
                "processes": [],
                "migDevices": [
                    {
                        "index": 0,
                        "uuid": mig_3g,
                        "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                        "memoryTotalMiB": 40192,
                        "processes": [
                            {"pid": pids["mig"], "usedMemoryMiB": 1024},
                            {"pid": pids["wrong"], "usedMemoryMiB": 512},
                        ],
                    },
                    {
                        "index": 1,
                        "uuid": mig_1g,
                        "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                        "memoryTotalMiB": 9728,
                        "processes": [{"pid": pids["dyn"], "usedMemoryMiB": 2048}],
                    },
                ],
            },
        ]
    )
    resource = client.ResourceV1Api(world.api)
    node, ns = world.node, world.ns
    create_gpu_slice(
        resource,
        node,
        [
            {"name": "gpu-0", "type": "gpu", "uuid": GPU0},
            {
                "name": "gpu-1-mig-3g40gb-0-4",
                "type": "mig",
                "uuid": mig_3g,
                "parentUUID": GPU1,
                "profile": "3g.40gb",
            },
            {
                "name": "gpu-1-mig-1g10gb-dyn",
                "type": "mig",
                "parentUUID": GPU1,
                "profile": "1g.10gb",
            },
        ],
    )
    create_allocated_claim(resource, ns, "mig-3g", node, ["gpu-1-mig-3g40gb-0-4"])
    create_allocated_claim(resource, ns, "dyn-1g-x2k9z", node, ["gpu-1-mig-1g10gb-dyn"])
    create_allocated_claim(resource, ns, "wrong-1g", node, ["gpu-1-mig-1g10gb-dyn"])

    wait_for(lambda: _reason(world, "wrong") == "True UsingUnallocatedGPU", what="wrong device")
    for name in ("mig", "dyn"):

        def inside(n: str = name) -> bool:
            return _reason(world, n) == "True ProcessesRunning"

        wait_for(inside, what=f"{name} inside its allocation")
    # the status is written after the pods in the same reconcile
    wait_for(lambda: report(world)["status"]["totals"]["unallocatedPods"] == 1, what="totals")
    entries = {p["name"]: p for p in report(world)["status"]["pods"]}
    assert entries["mig"]["allocatedDevices"] == [mig_3g]
    assert entries["dyn"]["allocatedDevices"] == [f"{GPU1}/1g.10gb"], "matched by parent, profile"
    assert (entries["wrong"]["deviceUUID"], entries["wrong"]["unallocated"]) == (mig_3g, True)
    assert mig_3g in (condition(pod(world, "wrong")).message or "")


def test_pods_sharing_a_claim_are_handed_their_part_of_its_gpu(make_world: WorldFactory) -> None:
    """Two pods share one claim whose GPU is time-sliced (an NVIDIA GpuConfig's `sharing`), a
    third has a claim whose GPU is shared by MPS with 30 % of the threads, a fourth a claim of
    its own: each entry's handedShare is its pod's part of the device (a half each; 0.3; none,
    the GPU is its own), read back from the real apiserver."""
    world = make_world(
        {"a": 0, "b": 0, "c": 0, "d": 0},
        pod_extras={
            "a": {"claims": {"gpu": "sliced"}},
            "b": {"claims": {"gpu": "sliced"}},
            "c": {"claims": {"gpu": "mps"}},
            "d": {"claims": {"gpu": "own"}},
        },
    )
    resource = client.ResourceV1Api(world.api)
    third = gpu_uuid(9)
    create_gpu_slice(
        resource,
        world.node,
        [
            {"name": "gpu-0", "type": "gpu", "uuid": GPU0},
            {"name": "gpu-1", "type": "gpu", "uuid": GPU1},
            {"name": "gpu-2", "type": "gpu", "uuid": third},
        ],
    )
    create_allocated_claim(
        resource,
        world.ns,
        "sliced",
        world.node,
        ["gpu-0"],
        sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}},
        reserved_for={"a": world.uids["a"], "b": world.uids["b"]},
    )
    create_allocated_claim(
        resource,
        world.ns,
        "mps",
        world.node,
        ["gpu-1"],
        sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}},
        reserved_for={"c": world.uids["c"]},
    )
    create_allocated_claim(
        resource, world.ns, "own", world.node, ["gpu-2"], reserved_for={"d": world.uids["d"]}
    )

    def gpu(index: int, uuid: str, names: tuple[str, ...]) -> dict[str, Any]:
        listed = [{"pid": world.pids[n], "usedMemoryMiB": 1024, "smUtil": 50} for n in names]
        return {"index": index, "uuid": uuid, "memoryTotalMiB": 81920, "processes": listed}

    world.scenario([gpu(0, GPU0, ("a", "b")), gpu(1, GPU1, ("c",)), gpu(2, third, ("d",))])

    def handed() -> dict[str, Any] | None:
        entries = {n: _entries(world, n) for n in ("a", "b", "c", "d")}
        if not all(len(found) == 1 for found in entries.values()):
            return None
        return {n: found[0].get("handedShare") for n, found in entries.items()}

    shares = wait_for(
        lambda: (found := handed()) is not None and found["a"] is not None and found,
        what="the handed shares",
    )
    assert shares == {"a": 0.5, "b": 0.5, "c": 0.3, "d": None}
    (a,) = _entries(world, "a")
    assert (a["allocatedBy"], a["allocatedDevices"]) == (["DRA"], [GPU0])
    assert not a.get("unallocated"), "a shared claim's device is each pod's allocation"
