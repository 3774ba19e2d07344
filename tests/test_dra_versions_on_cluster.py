"""DRA as Kubernetes 1.32 and 1.33 serve it (resource.k8s.io/v1beta1, v1beta2; no v1): the
operator reads the version served, on a real control plane started with only that version."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import create_allocated_claim, create_gpu_slice, ensure_namespace
from gpuusage_operator.index.pods import snapshot_of
from gpuusage_operator.informers.drawatch import DraWatch, resource_apis
from gpuusage_operator.judge.allocation import allocation_of
from gpuusage_operator.judge.requests import DEFAULT_RULES, PodClaims
from tests.conftest import wait_for
from tests.fakenvml import gpu_uuid

pytestmark = pytest.mark.cluster

SERVED = {
    "v1beta2": "resource.k8s.io/v1=false,resource.k8s.io/v1beta2=true",  # as 1.33 serves it
    "v1beta1": "resource.k8s.io/v1=false,resource.k8s.io/v1beta1=true",  # as 1.32 does
}


@pytest.fixture(params=sorted(SERVED), scope="module")
def beta(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LocalCluster]]:
    version: str = request.param
    cluster = LocalCluster(
        tmp_path_factory.mktemp(f"dra-{version}"),
        apiserver_args=[f"--runtime-config={SERVED[version]}"],
        tie_to_parent=True,
    )
    cluster.up()
    try:
        yield version, cluster
    finally:
        cluster.down()


def test_claims_are_read_through_the_beta_version_served(beta: tuple[str, LocalCluster]) -> None:
    version, cluster = beta
    api, _ = api_client(cluster.kubeconfig)
    # The test writes through the generated API of its version; the operator reads through
    # resource_apis.
    resource = {"v1beta1": client.ResourceV1beta1Api, "v1beta2": client.ResourceV1beta2Api}[
        version
    ](api)
    core = client.CoreV1Api(api)
    ensure_namespace(core, "ml")
    create_gpu_slice(
        resource, "gpu-b", [{"name": "gpu-0", "type": "gpu", "uuid": gpu_uuid(0)}], version
    )
    create_allocated_claim(resource, "ml", "train-gpu", "gpu-b", ["gpu-0"], version=version)
    watch = DraWatch(resource_apis(api))
    watch.start()
    try:
        wait_for(lambda: watch.synced, what="DRA listed")
        assert watch.available.is_set()
        assert watch.version == version
        pod = {
            "metadata": {"name": "train", "namespace": "ml", "uid": "u-1"},
            "spec": {
                "nodeName": "gpu-b",
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "train-gpu"}],
            },
            "status": {"phase": "Running"},
        }
        found = snapshot_of(pod)
        assert found is not None
        claimed = found.claimed
        allocation = wait_for(
            lambda: (a := allocation_of(claimed, watch.lookup(), DEFAULT_RULES)).devices and a,
            what="the claim's device",
        )
        assert [d.uuid for d in allocation.devices] == [gpu_uuid(0)]
        assert allocation.complete
    finally:
        watch.stop()


@pytest.mark.skipif(
    versions.minor(versions.choose()) < 36,
    reason="Kubernetes 1.35 does not serve shared devices or counters by default "
    "(DRAConsumableCapacity and DRAPartitionableDevices are alpha there, off)",
)
def test_shared_devices_and_counters_are_read_through_the_beta_version_served(
    beta: tuple[str, LocalCluster],
) -> None:
    """A GPU several claims share (`allowMultipleAllocations`, `capacity`; under `basic` in
    v1beta1), a slice of shared counters alone, and a claim's result with its `shareID` and
    `consumedCapacity`, written at the beta version and read through it."""
    version, cluster = beta
    api, _ = api_client(cluster.kubeconfig)
    custom = client.CustomObjectsApi(api)
    ensure_namespace(client.CoreV1Api(api), "team")
    fields = {
        "attributes": {"uuid": {"string": gpu_uuid(5)}},
        "allowMultipleAllocations": True,
        "capacity": {"memory": {"value": "80Gi"}, "shares": {"value": "4"}},
    }
    device = {"name": "gpu-5", **({"basic": fields} if version == "v1beta1" else fields)}
    pool = {"name": "gpu-s", "generation": 1, "resourceSliceCount": 2}
    for name, part in (
        ("devices", {"devices": [device]}),
        ("counters", {"sharedCounters": [{"name": "gpu-5", "counters": {"m": {"value": "1"}}}]}),
    ):
        body = {
            "apiVersion": f"resource.k8s.io/{version}",
            "kind": "ResourceSlice",
            "metadata": {"name": f"gpu-s-{name}"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "gpu-s", "pool": pool, **part},
        }
        custom.create_cluster_custom_object("resource.k8s.io", version, "resourceslices", body)
    request = {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}
    claim = {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": "part"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", **request}
                    if version == "v1beta1"
                    else {"name": "gpu", "exactly": request}
                ]
            }
        },
    }
    custom.create_namespaced_custom_object(
        "resource.k8s.io", version, "team", "resourceclaims", claim
    )
    result = {
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": "gpu-s",
        "device": "gpu-5",
        "shareID": "7d0c9d8e-1111-4222-8333-444455556666",
        "consumedCapacity": {"memory": "20Gi", "shares": "1"},
    }
    custom.patch_namespaced_custom_object_status(
        "resource.k8s.io",
        version,
        "team",
        "resourceclaims",
        "part",
        {"status": {"allocation": {"devices": {"results": [result]}}}},
    )
    watch = DraWatch(resource_apis(api))
    watch.start()
    try:
        wait_for(lambda: watch.synced, what="DRA listed")
        assert watch.version == version
        claimed = PodClaims("team", "p", claims=("part",))
        allocation = wait_for(
            lambda: (a := allocation_of(claimed, watch.lookup(), DEFAULT_RULES)).devices and a,
            what="the claim's part of the device",
        )
        found = [(d.uuid, d.share, d.memory_mib, d.partial) for d in allocation.devices]
        assert found == [(gpu_uuid(5), 0.25, 20480, True)]
    finally:
        watch.stop()
