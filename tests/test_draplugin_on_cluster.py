"""Our DRA driver against the real kube-apiserver and kube-scheduler 1.37.2, without a kubelet.

The control plane runs as the local node's does (the Node authorizer and NodeRestriction on),
and the driver publishes with the node's own identity (`system:node:NAME`). A Node object
written by hand stands in for the kubelet's; the real scheduler allocates the claims of pods
that ask for the driver's devices three ways (a whole GPU by the extended resource
`nvidia.com/gpu`, shares of one GPU's memory, MIG partitions out of one GPU's counters) and
binds the pods to the node. Where the kubelet would then call the driver, the tests make its
calls by hand (kubeletcalls: registration handshake, NodePrepareResources,
NodeUnprepareResources) and read the CDI specs the driver writes. That a container gets them is
for the real node's tests (a runtime with CDI).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuusage.kube.errors import ApiError
from gpuusage.kube.rest import RestClient
from gpuusage_dev.draplugin import (
    CDI_KIND,
    DRIVER,
    DraPlugin,
    cdi_spec_path,
    device_classes,
    dynamic_mig_uuid,
)
from gpuusage_dev.draplugin.kubeletcalls import (
    Claim,
    notify_registered,
    plugin_info,
    prepare,
    unprepare,
)
from gpuusage_dev.localcluster.binaries import ensure_node_binaries
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.localcluster.node import kubeconfig, node_cluster
from gpuusage_dev.localcluster.pki import client_certificate
from tests.conftest import wait_for

pytestmark = pytest.mark.cluster

NODE = "dra-node"
NS = "dra"
WHOLE = "GPU-a0a00000-0000-4000-8000-000000000000"
SHARED = "GPU-a1a10000-0000-4000-8000-000000000001"
PARTED = "GPU-a2a20000-0000-4000-8000-000000000002"
MIGGED = "GPU-a3a30000-0000-4000-8000-000000000003"
MIG_3G = "MIG-a3a30000-0000-4000-8000-0000000003a0"
MIG_1G = "MIG-a3a30000-0000-4000-8000-0000000003a1"
A100 = "NVIDIA A100-SXM4-80GB"
SCENARIO: dict[str, Any] = {
    "driverVersion": "550.54.15",
    "cudaVersion": "12.4",
    "gpus": [
        {"index": 0, "uuid": WHOLE, "name": "NVIDIA H100 80GB HBM3", "memoryTotalMiB": 81559},
        {"index": 1, "uuid": SHARED, "name": A100, "memoryTotalMiB": 81920},
        {"index": 2, "uuid": PARTED, "name": A100, "memoryTotalMiB": 81920},
        {
            "index": 3,
            "uuid": MIGGED,
            "name": A100,
            "memoryTotalMiB": 81920,
            "migDevices": [
                {
                    "index": 0,
                    "uuid": MIG_3G,
                    "name": f"{A100} MIG 3g.40gb",
                    "memoryTotalMiB": 40192,
                },
                {"index": 1, "uuid": MIG_1G, "name": f"{A100} MIG 1g.10gb", "memoryTotalMiB": 9728},
            ],
        },
    ],
}
SLICES = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.driver%3D{DRIVER}"


@dataclass
class World:
    cluster: LocalCluster
    admin: RestClient
    plugin: DraPlugin
    cdi: Path


def _scheduler(cluster: LocalCluster, folder: Path) -> subprocess.Popen[bytes]:
    """The real kube-scheduler of the cluster's release, under its own identity."""
    pki = cluster.directory / "pki"
    cert, key = client_certificate(pki, "kube-scheduler", "/CN=system:kube-scheduler")
    config = kubeconfig(
        folder / "scheduler.kubeconfig", cluster.server, pki / "ca.crt", cert, key, user="sched"
    )
    binary = ensure_node_binaries(version=cluster.kubernetes_version).kube_scheduler
    with (folder / "kube-scheduler.log").open("ab") as log:
        return subprocess.Popen(
            [
                str(binary),
                f"--kubeconfig={config}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
            ],
            stdout=log,
            stderr=log,
        )


def _node(admin: RestClient) -> None:
    """The Node as a Ready kubelet has it: schedulable, with room for pods (without the
    not-ready taint the apiserver gives a new Node until its kubelet says it is Ready)."""
    admin.post("/api/v1/nodes", {"metadata": {"name": NODE, "labels": {"gpu": "yes"}}})
    admin.request(
        "PATCH", f"/api/v1/nodes/{NODE}", {"spec": {"taints": None}}, "application/merge-patch+json"
    )
    room = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    status = {"capacity": room, "allocatable": room}
    admin.request(
        "PATCH",
        f"/api/v1/nodes/{NODE}/status",
        {"status": status},
        "application/merge-patch+json",
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("dra")
    # kube-apiserver 1.37 refuses a loopback advertise address with its endpoint reconciler
    cluster = node_cluster(
        root / "cp", tie_to_parent=True, apiserver_args=["--endpoint-reconciler-type=none"]
    )
    cluster.up()
    scheduler: subprocess.Popen[bytes] | None = None
    plugin: DraPlugin | None = None
    admin, _ = RestClient.from_kubeconfig(cluster.kubeconfig)
    try:
        _node(admin)
        admin.post("/api/v1/namespaces", {"metadata": {"name": NS}})
        admin.post(f"/api/v1/namespaces/{NS}/serviceaccounts", {"metadata": {"name": "default"}})
        for body in device_classes():
            admin.post("/apis/resource.k8s.io/v1/deviceclasses", body)
        pki = cluster.directory / "pki"
        cert, key = client_certificate(pki, "dra-node", f"/O=system:nodes/CN=system:node:{NODE}")
        identity = kubeconfig(
            root / "node.kubeconfig", cluster.server, pki / "ca.crt", cert, key, user="node"
        )
        cdi = root / "cdi"
        plugin = DraPlugin(
            SCENARIO,
            NODE,
            identity,
            root / "driver",
            cdi_dir=cdi,
            registrar_dir=root / "kubelet" / "plugins_registry",
            plugin_data_dir=root / "plugins" / DRIVER,
            shared=[SHARED],
            partitionable=[PARTED],
        )
        plugin.start(timeout=90)
        scheduler = _scheduler(cluster, root)
        yield World(cluster, admin, plugin, cdi)
    finally:
        if plugin is not None:
            plugin.stop()
        if scheduler is not None:
            scheduler.terminate()
            scheduler.wait(20)
        admin.close()
        cluster.down()


def _slices(world: World) -> list[dict[str, Any]]:
    return list(world.admin.get(SLICES)["items"])


def _devices(world: World) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in _slices(world) for d in s["spec"].get("devices") or []}


def _attrs(device: dict[str, Any]) -> dict[str, str]:
    return {k: next(iter(v.values())) for k, v in (device.get("attributes") or {}).items()}


def test_slices_are_published_by_the_nodes_own_identity(world: World) -> None:
    """One pool named after the node: the counter sets in a slice of their own, then one slice
    of devices per GPU, every slice owned by the Node and bound to it (NodeRestriction let the
    node's identity create them)."""
    slices = _slices(world)
    assert len(slices) == 5
    for s in slices:
        assert s["spec"]["nodeName"] == NODE
        assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 5}
        assert [(o["kind"], o["name"]) for o in s["metadata"]["ownerReferences"]] == [
            ("Node", NODE)
        ]
    counters = [s["spec"]["sharedCounters"] for s in slices if s["spec"].get("sharedCounters")]
    assert counters == [
        [
            {
                "name": "gpu-2-counter-set",
                "counters": {
                    "memory": {"value": "80Gi"},
                    **{f"memory-slice-{i}": {"value": "1"} for i in range(8)},
                },
            }
        ]
    ]


def test_devices_are_named_and_described_as_nvidias_driver_does(world: World) -> None:
    devices = _devices(world)
    whole = devices["gpu-0"]
    assert _attrs(whole) == {
        "type": "gpu",
        "uuid": WHOLE,
        "productName": "NVIDIA H100 80GB HBM3",
        "driverVersion": "550.54.15",
        "cudaDriverVersion": "12.4.0",
    }
    assert whole["capacity"] == {"memory": {"value": "81559Mi"}}
    shared = devices["gpu-1"]
    assert shared["allowMultipleAllocations"] is True
    assert shared["capacity"]["memory"] == {
        "value": "80Gi",
        "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
    }
    static = {n: _attrs(d) for n, d in devices.items() if n.startswith("gpu-3-")}
    assert {
        n: (a["type"], a["uuid"], a["parentUUID"], a["profile"]) for n, a in static.items()
    } == {
        "gpu-3-mig-3g40gb-9-0": ("mig", MIG_3G, MIGGED, "3g.40gb"),
        "gpu-3-mig-1g10gb-19-4": ("mig", MIG_1G, MIGGED, "1g.10gb"),
    }
    parted = {n: d for n, d in devices.items() if n.startswith("gpu-2")}
    assert len(parted) == 1 + 7 + 3 + 2 + 1 + 1
    assert _attrs(parted["gpu-2"])["uuid"] == PARTED
    assert parted["gpu-2"]["consumesCounters"][0]["counterSet"] == "gpu-2-counter-set"
    mig = parted["gpu-2-mig-3g40gb-9-4"]
    assert "uuid" not in _attrs(mig)  # made when a claim is prepared
    assert (_attrs(mig)["parentUUID"], _attrs(mig)["profile"]) == (PARTED, "3g.40gb")
    assert mig["consumesCounters"] == [
        {
            "counterSet": "gpu-2-counter-set",
            "counters": {
                "memory": {"value": "40Gi"},
                **{f"memory-slice-{i}": {"value": "1"} for i in range(4, 8)},
            },
        }
    ]


def test_registration_handshake_as_the_kubelets_plugin_watcher_does_it(world: World) -> None:
    info = plugin_info(world.plugin.registration_socket)
    assert (info.type, info.name, info.endpoint) == (
        "DRAPlugin",
        DRIVER,
        str(world.plugin.dra_socket),
    )
    assert "v1.DRAPlugin" in info.supported_versions
    notify_registered(world.plugin.registration_socket)
    assert world.plugin.wait_registered(10)


def _pod(world: World, name: str, claims: tuple[str, ...] = (), gpus: int = 0) -> None:
    container: dict[str, Any] = {"name": "main", "image": "gpuusage.local/busybox:1"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if claims:
        container["resources"] = {"claims": [{"name": c} for c in claims]}
    spec: dict[str, Any] = {"containers": [container], "nodeSelector": {"gpu": "yes"}}
    if claims:
        spec["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
    world.admin.post(f"/api/v1/namespaces/{NS}/pods", {"metadata": {"name": name}, "spec": spec})


def _claim(world: World, name: str, requests: list[dict[str, Any]]) -> None:
    world.admin.post(
        f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims",
        {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}},
    )


def _scheduled(world: World, pod: str) -> dict[str, Any]:
    def bound() -> dict[str, Any] | None:
        body = world.admin.get(f"/api/v1/namespaces/{NS}/pods/{pod}")
        return body if body["spec"].get("nodeName") == NODE else None

    return dict(wait_for(bound, 60, f"pod {pod} bound to {NODE}"))


def _unschedulable(world: World, pod: str) -> str:
    def said() -> str | None:
        body = world.admin.get(f"/api/v1/namespaces/{NS}/pods/{pod}")
        for c in body.get("status", {}).get("conditions") or []:
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                return str(c.get("message", ""))
        return None

    return str(wait_for(said, 60, f"pod {pod} unschedulable"))


def _allocated(world: World, claim: str) -> dict[str, Any]:
    return dict(world.admin.get(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{claim}"))


def _prepared(world: World, body: dict[str, Any]) -> tuple[Claim, list[str]]:
    """Prepare the claim as the kubelet would; the NVIDIA_VISIBLE_DEVICES its CDI devices set."""
    meta = body["metadata"]
    claim = Claim(meta["namespace"], meta["name"], meta["uid"])
    result = prepare(world.plugin.dra_socket, [claim])[claim.uid]
    assert result.error == ""
    spec = json.loads(cdi_spec_path(world.cdi, claim.uid).read_text())
    assert spec["kind"] == CDI_KIND
    ids = [i for d in result.devices for i in d.cdi_device_ids]
    assert ids == [f"{CDI_KIND}={d['name']}" for d in spec["devices"]]
    env = [e for d in spec["devices"] for e in d["containerEdits"]["env"]]
    return claim, env


def test_a_pod_asking_nvidia_com_gpu_is_given_a_whole_gpu_of_the_driver(world: World) -> None:
    """KEP-5004: no device plugin advertises nvidia.com/gpu here, so the scheduler gives the pod
    a device of the DeviceClass that names it, through a claim it makes for the pod."""
    _pod(world, "whole", gpus=1)
    pod = _scheduled(world, "whole")
    made = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    body = _allocated(world, made)
    (result,) = body["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (DRIVER, NODE, "gpu-0")
    claim, env = _prepared(world, body)
    assert env == [f"NVIDIA_VISIBLE_DEVICES={WHOLE}"]
    assert unprepare(world.plugin.dra_socket, [claim]) == {claim.uid: ""}
    assert not cdi_spec_path(world.cdi, claim.uid).exists()


def _share(uuid: str, memory: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "gpu",
            "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [
                    {"cel": {"expression": f"device.attributes['{DRIVER}'].uuid == '{uuid}'"}}
                ],
                "capacity": {"requests": {"memory": memory}},
            },
        }
    ]


def test_two_pods_share_one_gpus_memory(world: World) -> None:
    """KEP-5075: each claim consumes 20Gi of the shared GPU's 80Gi; both pods land on it, each
    claim gets its own share and CDI device, both with the GPU's UUID. A third asking 50Gi
    finds too little left."""
    for name in ("share-a", "share-b"):
        _claim(world, name, _share(SHARED, "20Gi"))
        _pod(world, name, (name,))
    shares = set()
    for name in ("share-a", "share-b"):
        _scheduled(world, name)
        body = _allocated(world, name)
        (result,) = body["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-1"
        assert result["consumedCapacity"] == {"memory": "20Gi"}
        shares.add(result["shareID"])
        claim, env = _prepared(world, body)
        assert env == [f"NVIDIA_VISIBLE_DEVICES={SHARED}"]
        spec = json.loads(cdi_spec_path(world.cdi, claim.uid).read_text())
        assert [d["name"] for d in spec["devices"]] == [f"{claim.uid}-gpu-1-{result['shareID']}"]
    assert len(shares) == 2
    _claim(world, "share-c", _share(SHARED, "50Gi"))
    _pod(world, "share-c", ("share-c",))
    assert "cannot allocate all claims" in _unschedulable(world, "share-c")
    _claim(world, "share-d", _share(SHARED, "40Gi"))  # what is left
    _pod(world, "share-d", ("share-d",))
    _scheduled(world, "share-d")


def _mig(profile: str, parent: str, name: str) -> dict[str, Any]:
    expression = (
        f"device.attributes['{DRIVER}'].profile == '{profile}' && "
        f"device.attributes['{DRIVER}'].parentUUID == '{parent}'"
    )
    return {
        "name": name,
        "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": expression}}],
        },
    }


def test_mig_devices_are_cut_from_one_gpus_counters(world: World) -> None:
    """KEP-4815: a 3g and a 4g MIG device of the partitionable GPU fit only as 4g at 0 and 3g at
    4 (memory slices 0-3 and 4-7): the scheduler finds that placement; then no memory slice is
    left, and a pod asking a 1g of that GPU cannot be scheduled. Preparing makes the MIG devices
    up with the UUIDs dynamic_mig_uuid gives."""
    _claim(world, "parts", [_mig("3g.40gb", PARTED, "big"), _mig("4g.40gb", PARTED, "bigger")])
    _pod(world, "parts", ("parts",))
    _scheduled(world, "parts")
    body = _allocated(world, "parts")
    got = {r["request"]: r["device"] for r in body["status"]["allocation"]["devices"]["results"]}
    assert got == {"big": "gpu-2-mig-3g40gb-9-4", "bigger": "gpu-2-mig-4g40gb-5-0"}
    claim, env = _prepared(world, body)
    uuids = [dynamic_mig_uuid(PARTED, got[r], claim.uid) for r in ("big", "bigger")]
    assert env == [f"NVIDIA_VISIBLE_DEVICES={','.join(uuids)}"] * 2
    created = world.plugin.created_mig_devices()
    assert sorted((m["uuid"], m["profile"], m["parentUUID"]) for m in created) == sorted(
        zip(uuids, ("3g.40gb", "4g.40gb"), (PARTED, PARTED), strict=True)
    )
    _claim(world, "small", [_mig("1g.10gb", PARTED, "small")])
    _pod(world, "small", ("small",))
    assert "cannot allocate all claims" in _unschedulable(world, "small")
    assert unprepare(world.plugin.dra_socket, [claim]) == {claim.uid: ""}
    assert world.plugin.created_mig_devices() == []


def test_a_mig_device_made_beforehand_carries_its_own_uuid(world: World) -> None:
    _claim(world, "static", [_mig("1g.10gb", MIGGED, "one")])
    _pod(world, "static", ("static",))
    _scheduled(world, "static")
    body = _allocated(world, "static")
    (result,) = body["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-3-mig-1g10gb-19-4"
    _, env = _prepared(world, body)
    assert env == [f"NVIDIA_VISIBLE_DEVICES={MIG_1G}"]


def test_the_node_identity_cannot_publish_for_another_node(world: World) -> None:
    """What makes the node's own identity safe to publish with: NodeRestriction refuses it a
    slice of any other node."""
    pki = world.cluster.directory / "pki"
    identity = kubeconfig(
        pki.parent / "node-b.kubeconfig",
        world.cluster.server,
        pki / "ca.crt",
        *client_certificate(pki, "dra-node", f"/O=system:nodes/CN=system:node:{NODE}"),
        user="node",
    )
    node, _ = RestClient.from_kubeconfig(identity)
    other = {
        "metadata": {"generateName": "x-"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "another-node",
            "pool": {"name": "another-node", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }
    with node, pytest.raises(ApiError, match="same NodeName"):
        node.post("/apis/resource.k8s.io/v1/resourceslices", other)


def test_stop_removes_its_sockets(world: World, tmp_path: Path) -> None:
    """Another instance in folders of its own, for a node that does not exist (it serves, and
    never publishes): stopped, both its sockets are gone."""
    other = DraPlugin(
        {"gpus": []},
        "no-such-node",
        world.cluster.kubeconfig,
        tmp_path / "driver",
        cdi_dir=tmp_path / "cdi",
        registrar_dir=tmp_path / "reg",
        plugin_data_dir=tmp_path / "plugin",
    )
    other.start(timeout=60, published=False)
    assert other.registration_socket.is_socket()
    assert other.dra_socket.is_socket()
    other.stop()
    assert not other.registration_socket.exists()
    assert not other.dra_socket.exists()
