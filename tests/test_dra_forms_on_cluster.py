"""DRA's 1.36/1.37 forms on the real control plane (kube-apiserver 1.37.2, default feature
gates), written as the scheduler and a DRA driver write them, and judged end to end by the
operator: a DeviceClass serving `nvidia.com/gpu` (KEP-5004) and a pod whose GPU its special
claim holds (`status.extendedResourceClaimStatus`, through pods/status); a GPU several claims
share by consumable capacity (KEP-5075: `allowMultipleAllocations`, `capacity`, and results with
`shareID` and `consumedCapacity`, through the claims' status); MIG devices drawn from a GPU's
shared counters, the counters in a slice of their own (KEP-4815); a time-sliced claim reserved
for a PodGroup (KEP-5729).

The objects go through the object API as JSON, so that what the apiserver keeps is read back
as it is, whatever the client's models know."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from gpuusage_dev.localcluster import versions
from tests.conftest import WorldFactory, wait_for
from tests.fakenvml import gpu_uuid, mig_uuid
from tests.simworld import SimWorld
from tests.worldview import condition, pod, report

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        versions.minor(versions.choose()) < 36,
        reason="Kubernetes 1.35 serves none of these forms by default (DRAExtendedResource, "
        "DRAConsumableCapacity and DRAPartitionableDevices are alpha there, off)",
    ),
]

GROUP, VERSION = "resource.k8s.io", "v1"
DRIVER = "gpu.nvidia.com"
GPUS = [gpu_uuid(i) for i in range(4)]
MIG_1G, MIG_3G = mig_uuid(1), mig_uuid(3)
COUNTER_SET = "gpu-3-counter-set"
REQUEST = "container-0-request-0"
"""The name the scheduler gives the special claim's request for a container's resource."""


class Dra:
    """Writes resource.k8s.io objects as JSON and reads them back (the object API)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)

    def create(self, plural: str, body: dict[str, Any], namespace: str | None = None) -> Any:
        body = {"apiVersion": f"{GROUP}/{VERSION}", **body}
        if namespace is None:
            return self.custom.create_cluster_custom_object(GROUP, VERSION, plural, body)
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)

    def claim(
        self,
        namespace: str,
        name: str,
        results: list[dict[str, Any]],
        *,
        request: str = "gpu",
        device_class: str = DRIVER,
        meta: dict[str, Any] | None = None,
        capacity: dict[str, str] | None = None,
        config: list[dict[str, Any]] | None = None,
        reserved_for: list[dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        """A claim as a user or the scheduler makes it, then allocated as the scheduler writes
        it through the status subresource; the stored claim is returned."""
        exactly: dict[str, Any] = {"deviceClassName": device_class, "count": len(results)}
        if capacity:
            exactly["capacity"] = {"requests": capacity}
        devices: dict[str, Any] = {"requests": [{"name": request, "exactly": exactly}]}
        if config:
            devices["config"] = config
        self.create(
            "resourceclaims",
            {
                "kind": "ResourceClaim",
                "metadata": {"name": name, **(meta or {})},
                "spec": {"devices": devices},
            },
            namespace,
        )
        allocated: dict[str, Any] = {
            "results": [{"request": request, "driver": DRIVER, **r} for r in results]
        }
        if config:
            allocated["config"] = [{"source": "FromClaim", **c} for c in config]
        status: dict[str, Any] = {"allocation": {"devices": allocated}}
        if reserved_for:
            status["reservedFor"] = reserved_for
        stored: Any = self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, "resourceclaims", name, {"status": status}
        )
        return dict(stored)


@pytest.fixture
def device_class(api: client.ApiClient) -> Iterator[str]:
    """A DeviceClass of NVIDIA's driver that serves the extended resource nvidia.com/gpu."""
    name = f"gpu-{uuid.uuid4().hex[:6]}.nvidia.com"
    body = {
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {
            "selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }
    stored = Dra(api).create("deviceclasses", body)
    assert stored["spec"]["extendedResourceName"] == "nvidia.com/gpu", "kept by the apiserver"
    yield name
    client.CustomObjectsApi(api).delete_cluster_custom_object(GROUP, VERSION, "deviceclasses", name)


def _slices(dra: Dra, node: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two slices of one pool, as a driver with dynamic MIG and consumable shares publishes
    them: the devices (a shared GPU with its capacity; MIG devices consuming the counters of
    GPU 3, one created already with its UUID, one to be created at prepare time), and GPU 3's
    counters alone (1.37 keeps a slice's devices and shared counters apart)."""
    pool = {"name": node, "generation": 1, "resourceSliceCount": 2}

    def mig(name: str, profile: str, memory: str, start: int, uuid_: str | None) -> dict[str, Any]:
        attributes = {
            "type": {"string": "mig"},
            "parentUUID": {"string": GPUS[3]},
            "profile": {"string": profile},
            **({"uuid": {"string": uuid_}} if uuid_ else {}),
        }
        return {
            "name": name,
            "attributes": attributes,
            "capacity": {"memory": {"value": memory}},
            "consumesCounters": [
                {
                    "counterSet": COUNTER_SET,
                    "counters": {
                        "memory": {"value": memory},
                        f"memory-slice-{start}": {"value": "1"},
                    },
                }
            ],
        }

    def gpu(index: int, **extra: Any) -> dict[str, Any]:
        attributes = {"type": {"string": "gpu"}, "uuid": {"string": GPUS[index]}}
        return {"name": f"gpu-{index}", "attributes": attributes, **extra}

    devices = [
        gpu(0),
        gpu(1),
        gpu(
            2,
            allowMultipleAllocations=True,
            capacity={"memory": {"value": "80Gi"}, "shares": {"value": "4"}},
        ),
        mig("gpu-3-mig-1g10gb-0-1", "1g.10gb", "10Gi", 0, None),
        mig("gpu-3-mig-3g40gb-4-4", "3g.40gb", "40Gi", 4, MIG_3G),
    ]
    counters = {
        "name": COUNTER_SET,
        "counters": {
            "memory": {"value": "80Gi"},
            **{f"memory-slice-{i}": {"value": "1"} for i in range(8)},
        },
    }
    made = []
    for kind, part in (("devices", devices), ("sharedCounters", [counters])):
        body = {
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}-{kind.lower()}"},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": pool, kind: part},
        }
        made.append(dra.create("resourceslices", body))
    return made[0], made[1]


def _extended(world: SimWorld, dra: Dra, name: str, device: str, device_class: str) -> None:
    """What the scheduler does for a pod whose nvidia.com/gpu a DRA driver serves: the special
    claim, owned by the pod, allocated and reserved for it, named in the pod's status."""
    claim = f"{name}-extended-resources-{uuid.uuid4().hex[:5]}"
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": name,
        "uid": world.uids[name],
        "controller": True,
    }
    dra.claim(
        world.ns,
        claim,
        [{"pool": world.node, "device": device}],
        request=REQUEST,
        device_class=device_class,
        meta={
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "ownerReferences": [owner],
        },
        reserved_for=[{"resource": "pods", "name": name, "uid": world.uids[name]}],
    )
    mapping = {
        "containerName": f"{name}-ctr",
        "resourceName": "nvidia.com/gpu",
        "requestName": REQUEST,
    }
    status = {
        "extendedResourceClaimStatus": {"resourceClaimName": claim, "requestMappings": [mapping]}
    }
    world.core.patch_namespaced_pod_status(name, world.ns, {"status": status})
    response = world.core.read_namespaced_pod_status(name, world.ns, _preload_content=False)
    stored = json.loads(response.data)  # type: ignore[attr-defined]  # as stored
    assert stored["status"]["extendedResourceClaimStatus"] == status["extendedResourceClaimStatus"]


def _reason(world: SimWorld, name: str) -> str:
    found = condition(pod(world, name))
    return f"{found.status} {found.reason}"


def _entries(world: SimWorld) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in report(world).get("status", {}).get("pods", [])}


def test_dra_forms_of_kubernetes_1_37_are_judged_end_to_end(
    make_world: WorldFactory, device_class: str
) -> None:
    names = ("ext", "ext-out", "small", "large", "mig", "mig-wrong", "g1", "g2")
    world = make_world(
        dict.fromkeys(names, 0) | {"ext": 1, "ext-out": 1},
        pod_extras={
            "small": {"claims": {"gpu": "small"}},
            "large": {"claims": {"gpu": "large"}},
            "mig": {"claims": {"gpu": "mig-1g"}},
            "mig-wrong": {"claims": {"gpu": "mig-3g"}},
            "g1": {"claims": {"gpu": "group"}},
            "g2": {"claims": {"gpu": "group"}},
        },
    )
    pids, node, ns = world.pids, world.node, world.ns

    def on(*who: str) -> list[dict[str, Any]]:
        return [{"pid": pids[n], "usedMemoryMiB": 10240, "smUtil": 50} for n in who]

    world.scenario(
        [
            {
                "index": 0,
                "uuid": GPUS[0],
                "memoryTotalMiB": 81920,
                "processes": on("ext-out", "g1", "g2"),
            },
            {"index": 1, "uuid": GPUS[1], "memoryTotalMiB": 81920, "processes": on("ext")},
            {
                "index": 2,
                "uuid": GPUS[2],
                "memoryTotalMiB": 81920,
                "processes": on("small", "large"),
            },
            {
                "index": 3,
                "uuid": GPUS[3],
                "memoryTotalMiB": 81920,
                "processes": [],
                "migDevices": [
                    {
                        "index": 0,
                        "uuid": MIG_1G,
                        "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                        "memoryTotalMiB": 9728,
                        "processes": on("mig", "mig-wrong"),
                    },
                    {
                        "index": 1,
                        "uuid": MIG_3G,
                        "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                        "memoryTotalMiB": 40192,
                        "processes": [],
                    },
                ],
            },
        ]
    )
    dra = Dra(world.api)
    devices, counters = _slices(dra, node)
    # What the apiserver kept, with its default feature gates (DRAPartitionableDevices and
    # DRAConsumableCapacity are beta and on by default in 1.37)
    shared = next(d for d in devices["spec"]["devices"] if d["name"] == "gpu-2")
    assert shared["allowMultipleAllocations"] is True
    assert shared["capacity"]["shares"] == {"value": "4"}
    dynamic = next(d for d in devices["spec"]["devices"] if d["name"] == "gpu-3-mig-1g10gb-0-1")
    assert dynamic["consumesCounters"][0]["counterSet"] == COUNTER_SET
    assert counters["spec"]["sharedCounters"][0]["name"] == COUNTER_SET
    assert "devices" not in counters["spec"]

    _extended(world, dra, "ext", "gpu-1", device_class)
    _extended(world, dra, "ext-out", "gpu-1", device_class)
    for name, memory, shares in (("small", "20Gi", "1"), ("large", "60Gi", "3")):
        stored = dra.claim(
            ns,
            name,
            [
                {
                    "pool": node,
                    "device": "gpu-2",
                    "shareID": str(uuid.uuid4()),
                    "consumedCapacity": {"memory": memory, "shares": shares},
                }
            ],
            capacity={"memory": memory, "shares": shares},
        )
        (result,) = stored["status"]["allocation"]["devices"]["results"]
        assert result["consumedCapacity"] == {"memory": memory, "shares": shares}
        assert result["shareID"]
    dra.claim(ns, "mig-1g", [{"pool": node, "device": "gpu-3-mig-1g10gb-0-1"}])
    dra.claim(ns, "mig-3g", [{"pool": node, "device": "gpu-3-mig-3g40gb-4-4"}])
    sharing = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": sharing,
    }
    group = dra.claim(
        ns,
        "group",
        [{"pool": node, "device": "gpu-0"}],
        config=[{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}],
        reserved_for=[
            {
                "apiGroup": "scheduling.k8s.io",
                "resource": "podgroups",
                "name": "team",
                "uid": str(uuid.uuid4()),
            }
        ],
    )
    assert group["status"]["reservedFor"][0]["resource"] == "podgroups"

    expected = {
        "ext": "True ProcessesRunning",
        "ext-out": "True UsingUnallocatedGPU",
        "small": "True ProcessesRunning",
        "large": "True ProcessesRunning",
        "mig": "True ProcessesRunning",
        "mig-wrong": "True UsingUnallocatedGPU",
        "g1": "True ProcessesRunning",
        "g2": "True ProcessesRunning",
    }

    def reasons() -> dict[str, str]:
        return {n: _reason(world, n) for n in names}

    wait_for(lambda: reasons() == expected, what="each pod judged", timeout=60)
    assert GPUS[0] in (condition(pod(world, "ext-out")).message or "")
    # the status is written after the pods in the same reconcile
    wait_for(lambda: report(world)["status"]["totals"]["unallocatedPods"] == 2, what="totals")

    def settled() -> dict[str, dict[str, Any]] | None:
        found = _entries(world)
        ready = found.get("g1", {}).get("handedShare") and found.get("small", {}).get("handedShare")
        return found if ready else None

    entries = wait_for(settled, what="the handed parts")
    ext, out = entries["ext"], entries["ext-out"]
    # KEP-5004: the claim's devices, from DRA, counted once; nothing unrequested
    assert (ext["allocatedBy"], ext["allocatedDevices"], ext.get("requestedGPUs", 0)) == (
        ["DRA"],
        [GPUS[1]],
        0,
    )
    assert not ext.get("unrequested")
    assert not ext.get("unallocated")
    assert (out["deviceUUID"], out["unallocated"], out["allocatedDevices"]) == (
        GPUS[0],
        True,
        [GPUS[1]],
    )
    # KEP-5075: each allocated the shared GPU, handed its part
    handed = {
        n: (
            entries[n]["allocatedDevices"],
            entries[n].get("handedShare"),
            entries[n].get("handedMemoryMiB"),
        )
        for n in ("small", "large")
    }
    assert handed == {
        "small": ([GPUS[2]], 0.25, 20480),
        "large": ([GPUS[2]], 0.75, 61440),
    }
    # KEP-4815: the dynamic MIG device by its parent and profile; the one with a UUID by it
    assert entries["mig"]["allocatedDevices"] == [f"{GPUS[3]}/1g.10gb"]
    assert (entries["mig-wrong"]["allocatedDevices"], entries["mig-wrong"]["unallocated"]) == (
        [MIG_3G],
        True,
    )
    # KEP-5729: two pods name the claim reserved for a PodGroup: half of the GPU each
    assert (entries["g1"]["handedShare"], entries["g2"]["handedShare"]) == (0.5, 0.5)

    allocations = {a["name"]: a for a in report(world)["status"]["allocations"]}
    assert (allocations["ext"].get("gpus"), allocations["ext"].get("gpuShare")) == (1, None)
    assert {
        n: (
            allocations[n].get("gpus", 0),
            allocations[n]["gpuShare"],
            allocations[n]["gpuMemoryShareMiB"],
        )
        for n in ("small", "large")
    } == {
        "small": (0, 0.25, 20480),
        "large": (0, 0.75, 61440),
    }
    assert allocations["mig"].get("migDevices") == 1
