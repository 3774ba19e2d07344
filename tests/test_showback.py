"""What each pod was handed, for showback: whole GPUs, MIG slices and shares counted apart."""

from __future__ import annotations

from gpuusage.api.models import MAX_ALLOCATIONS
from gpuusage_operator.index.pods import PodSnapshot, snapshot_of
from gpuusage_operator.judge.allocation import AllocatedDevice, Allocation
from gpuusage_operator.judge.requests import Share, share_of
from gpuusage_operator.judge.showback import pod_allocation, pod_allocations
from tests.fakenvml import gpu_uuid, mig_uuid

UID = "11111111-2222-4333-8444-555555555555"


def pod(**fields: object) -> PodSnapshot:
    return PodSnapshot("ml", "p", UID, "n1", running=True, **fields)  # type: ignore[arg-type]


def test_device_plugin_resources_split_into_whole_gpus_and_mig_slices() -> None:
    body = {
        "metadata": {"name": "p", "namespace": "ml", "uid": UID},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2"}}},
                {"name": "b", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}},
            ],
        },
        "status": {"phase": "Running"},
    }
    snapshot = snapshot_of(body)
    assert snapshot is not None
    assert (snapshot.gpu_requests, snapshot.mig_requests) == (3, 1)
    entry = pod_allocation(snapshot, Allocation(("DevicePlugin",)))
    assert entry is not None
    assert (entry.gpus, entry.mig_devices, entry.gpu_share) == (2, 1, None)


def test_claim_devices_count_as_what_they_are_and_the_kubelets_devices_not_twice() -> None:
    devices = (
        AllocatedDevice("claim a", gpu_uuid(0)),
        AllocatedDevice("claim b", mig_uuid(1)),
        AllocatedDevice("claim c", None, gpu_uuid(2), "1g.10gb"),  # MIG made at prepare time
        AllocatedDevice("kubelet", gpu_uuid(3)),  # the device of its nvidia.com/gpu: 1
    )
    entry = pod_allocation(pod(gpu_requests=1), Allocation(("DevicePlugin", "DRA"), devices))
    assert entry is not None
    assert (entry.gpus, entry.mig_devices) == (2, 2)


def test_a_share_is_a_share() -> None:
    assert share_of("gpu-fraction=0.5,gpu-memory=4096") == Share(0.5, 4096)
    assert share_of("gpu-fraction=half,gpu-memory=-3") == Share()
    assert share_of("") == Share()
    entry = pod_allocation(pod(fraction="gpu-fraction=0.25"), Allocation(("Fractional",)))
    assert entry is not None
    assert (entry.gpus, entry.mig_devices, entry.gpu_share) == (0, 0, 0.25)
    assert pod_allocation(pod(fraction="gpu-fraction=x"), Allocation(("Fractional",))) is None
    assert pod_allocation(pod(), Allocation()) is None, "handed nothing"


def test_a_node_lists_at_most_its_bound_and_counts_the_rest() -> None:
    pods = [
        PodSnapshot("ml", f"p{n:03d}", UID, "n1", gpu_requests=1, running=True)
        for n in reversed(range(MAX_ALLOCATIONS + 6))
    ]
    listed, omitted = pod_allocations(pods, lambda _: Allocation(("DevicePlugin",)))
    assert len(listed) == MAX_ALLOCATIONS
    assert omitted == 6
    assert listed[0].name == "p000", "sorted"
    assert pod_allocations(pods[:3], lambda _: Allocation(("DevicePlugin",)))[1] is None


def test_the_kubelets_devices_tell_mig_slices_handed_out_as_nvidia_com_gpu() -> None:
    """NVIDIA's device plugin in its "single" MIG strategy names a MIG slice nvidia.com/gpu;
    the kubelet's device IDs show what it is. Time-sliced replicas stay whole GPUs while the
    replicas their GPU is advertised as are not known, and count as their share once they
    are."""
    single = Allocation(("DevicePlugin",), (AllocatedDevice("kubelet", mig_uuid(0)),))
    entry = pod_allocation(pod(gpu_requests=1), single)
    assert entry is not None
    assert (entry.gpus, entry.mig_devices) == (0, 1)
    replica = Allocation(("DevicePlugin",), (AllocatedDevice("kubelet", gpu_uuid(0)),))
    entry = pod_allocation(pod(gpu_requests=2), replica)  # two replicas of one GPU, folded
    assert entry is not None
    assert (entry.gpus, entry.mig_devices) == (2, 0)
    known = AllocatedDevice("kubelet", gpu_uuid(0), share=0.5, replicas=2)  # 2 of its 4
    whole = AllocatedDevice("kubelet", gpu_uuid(1))
    entry = pod_allocation(pod(gpu_requests=3), Allocation(("DevicePlugin",), (known, whole)))
    assert entry is not None
    assert (entry.gpus, entry.mig_devices, entry.gpu_share) == (1, 0, 0.5)
