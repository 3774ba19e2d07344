"""GPUs handed out through DRA on the real node: the real kube-scheduler 1.37 allocates the
claims, the real kubelet has our DRA driver (`gpu.nvidia.com`) prepare them and containerd puts
the CDI specs' environment into the containers; the product, installed as users install it
(`kubectl apply -k` of the manifests through the local node's overlay), judges the pods.

The node runs no device plugin: a pod asking `nvidia.com/gpu` is given a GPU through the
DeviceClass that names that resource (KEP-5004), two pods share one GPU's memory by consumable
capacity (KEP-5075), and a MIG device is cut out of a partitionable GPU when its claim is
prepared (KEP-4815, dynamic MIG). The GPUs are the only simulated part: the scenario the agent
reads names the real pids of the pods' containers, and the test, playing the hardware, adds a
MIG device to it once the driver has made it, as NVML would list it then.

The tests run in order on one node: the extended-resource pod may be given any whole GPU of the
class, so it comes after the shared GPU is full and the partitionable one is cut, when only the
two whole GPUs are left to it. Skipped, with the reason, where the machine cannot run a node.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuusage.kube.rest import RestClient
from gpuusage_dev.draplugin import DRIVER, cdi_spec_path, dynamic_mig_uuid
from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.containerd import CDI_DIR
from gpuusage_dev.localcluster.node import DRA_SOCKETS, HOST_PATHS, write_scenario
from gpuusage_dev.localcluster.workloads import pod_spec, sleeper
from gpuusage_dev.simulation import ensure_namespace
from tests.conftest import wait_for
from tests.nodeworld import (
    NAME,
    NodeWorld,
    gpu_condition,
    host_pid,
    installed_world,
    node_report,
    wait_for_event,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

NS = "dra"
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
WHOLE = "GPU-d0d00000-0000-4000-8000-000000000000"
SPARE = "GPU-d1d10000-0000-4000-8000-000000000001"
SHARED = "GPU-d2d20000-0000-4000-8000-000000000002"
PARTED = "GPU-d3d30000-0000-4000-8000-000000000003"
SCENARIO: dict[str, Any] = {
    "gpus": [
        {"index": 0, "uuid": WHOLE, "name": H100, "memoryTotalMiB": 81559},
        {"index": 1, "uuid": SPARE, "name": H100, "memoryTotalMiB": 81559},
        {"index": 2, "uuid": SHARED, "name": A100, "memoryTotalMiB": 81920},
        {"index": 3, "uuid": PARTED, "name": A100, "memoryTotalMiB": 81920},
    ]
}
DRA_NODE_MINOR = 36
"""The first release whose DRA serves what this proves by default (extended resources,
consumable capacity, partitionable devices: beta and on from 1.36); the driver's helper is of
1.37 and serves 1.36's kubelet alike. A compat run on an older release skips, saying so."""
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/" + NS + "/resourceclaims"


@dataclass
class Hardware:
    """What the simulated GPUs show, kept whole across the tests (the agent reads the whole
    scenario file each cycle): processes by device UUID and the MIG devices made so far."""

    folder: Path
    processes: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    migs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def put(self, device: str, pid: int, mib: int) -> None:
        """The process `pid` on `device` alone (moved there from wherever it was)."""
        for listed in self.processes.values():
            listed[:] = [p for p in listed if p["pid"] != pid]
        self.processes.setdefault(device, []).append({"pid": pid, "usedMemoryMiB": mib})
        self.write()

    def make_mig(self, parent: str, uuid: str, profile: str, mib: int) -> None:
        made = self.migs.setdefault(parent, [])
        made.append(
            {
                "index": len(made),
                "uuid": uuid,
                "name": f"{A100} MIG {profile}",
                "memoryTotalMiB": mib,
            }
        )
        self.write()

    def write(self) -> None:
        gpus = [
            {**g, "migDevices": self.migs[g["uuid"]]} if g["uuid"] in self.migs else g
            for g in SCENARIO["gpus"]
        ]
        write_scenario(self.folder, self.processes, {"gpus": gpus})


@dataclass(frozen=True)
class DraWorld:
    node: NodeWorld
    admin: RestClient
    hardware: Hardware


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DraWorld]:
    release = versions.choose()
    if versions.minor(release) < DRA_NODE_MINOR:
        pytest.skip(
            f"Kubernetes {release} serves none of these DRA forms by default (1.36 is the first)"
        )
    directory = tmp_path_factory.mktemp("dra-node")
    for installed in installed_world(
        directory,
        gpus=SCENARIO,
        gpu_allocation="dra",
        shared=[SHARED],
        partitionable=[PARTED],
    ):
        _namespace(installed)
        admin, _ = RestClient.from_kubeconfig(installed.cluster.kubeconfig)
        with admin:
            yield DraWorld(installed, admin, Hardware(installed.scenario))
    _nothing_left(directory / "node")


def _nothing_left(node: Path) -> None:
    """The stopped node left none of the driver's sockets, no CDI spec of a claim still
    prepared when it stopped, and no host folder it did not find there (the CDI folders among
    them: the kubelet makes /etc/cdi for the agent's hostPath volume)."""
    prepared = json.loads((node / "dra-plugin" / "plugin" / "prepared.json").read_text())
    assert prepared, "pods ran until the node stopped"
    assert [u for u in prepared if cdi_spec_path(CDI_DIR, u).exists()] == []
    assert [s for s in DRA_SOCKETS if (node / s).exists()] == []
    found = json.loads((node / "host-paths.json").read_text())["paths"]
    assert sorted(str(p) for p in HOST_PATHS if p.exists()) == sorted(found)


# -- what the tests do on the node -------------------------------------------------------------


def _namespace(world: NodeWorld) -> None:
    """The tests' namespace, once the controller-manager has made its default ServiceAccount."""
    ensure_namespace(world.core, NS)
    wait_for(lambda: world.core.read_namespaced_service_account("default", NS), what="SA")


def _pod(world: DraWorld, name: str, *, claims: tuple[str, ...] = (), gpus: int = 0) -> None:
    container = sleeper(gpus)
    spec = pod_spec(container)
    if claims:
        container["resources"] = {"claims": [{"name": c} for c in claims]}
        spec["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
    body = {"metadata": {"name": name, "labels": {"app": name}}, "spec": spec}
    world.admin.post(f"/api/v1/namespaces/{NS}/pods", body)


def _claim(world: DraWorld, name: str, request: dict[str, Any]) -> None:
    body = {"metadata": {"name": name}, "spec": {"devices": {"requests": [request]}}}
    world.admin.post(CLAIMS, body)


def _request(device_class: str, expression: str, **more: Any) -> dict[str, Any]:
    selector = {"cel": {"expression": expression}}
    return {
        "name": "gpu",
        "exactly": {"deviceClassName": device_class, "selectors": [selector], **more},
    }


def _running(world: DraWorld, name: str) -> tuple[dict[str, Any], int]:
    """The pod once its container runs (started by the kubelet on the node), and its host pid."""

    def started() -> dict[str, Any] | None:
        body = world.admin.get(f"/api/v1/namespaces/{NS}/pods/{name}")
        statuses = body.get("status", {}).get("containerStatuses") or []
        running = body["status"].get("phase") == "Running" and statuses
        return body if running and statuses[0].get("containerID") else None

    pod = dict(wait_for(started, timeout=90, what=f"pod {name} running"))
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    return pod, host_pid(world.node, cid)


def _visible_devices(pid: int) -> str:
    """NVIDIA_VISIBLE_DEVICES as the container's process got it (from the CDI spec)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"NVIDIA_VISIBLE_DEVICES=")]
    assert len(found) == 1, f"NVIDIA_VISIBLE_DEVICES set {len(found)} times"
    return found[0]


def _result(world: DraWorld, claim: str) -> tuple[str, dict[str, Any]]:
    """The claim's UID and its one allocated device."""
    body = world.admin.get(f"{CLAIMS}/{claim}")
    (result,) = body["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, NAME)
    return str(body["metadata"]["uid"]), dict(result)


def _judged(world: DraWorld, pod: str, reason: str) -> dict[str, Any]:
    """The pod's entry in the report's status once its condition is True for `reason`."""

    def entry() -> dict[str, Any] | None:
        found = gpu_condition(world.node, NS, pod)
        if found is None or (found["status"], found["reason"]) != ("True", reason):
            return None
        listed = node_report(world.node).get("status", {}).get("pods") or []
        mine = [e for e in listed if e["namespace"] == NS and e["name"] == pod]
        unallocated = reason == "UsingUnallocatedGPU"
        return (
            mine[0] if len(mine) == 1 and mine[0].get("unallocated", False) == unallocated else None
        )

    return dict(wait_for(entry, timeout=120, what=f"{pod} judged {reason}"))


def _claim_devices(world: DraWorld, pod: str) -> list[dict[str, Any]]:
    """What the agent published of the pod's DRA devices (`spec.kubelet.pods[].claimDevices`)."""
    pods = node_report(world.node)["spec"].get("kubelet", {}).get("pods") or []
    mine = [p for p in pods if p["namespace"] == NS and p["name"] == pod]
    return list(mine[0].get("claimDevices") or []) if mine else []


def _published(world: DraWorld, pod: str, claim: str, device: str, uuid: str) -> None:
    wanted = [{"claim": claim, "driver": DRIVER, "pool": NAME, "device": device, "uuid": uuid}]
    wait_for(
        lambda: _claim_devices(world, pod) == wanted,
        timeout=60,
        what=f"the agent naming {pod}'s claim device {device} as {uuid}",
    )


# -- the tests, in order (see the module's docstring) -------------------------------------------


def test_a_mig_device_made_for_a_claim_is_judged_as_the_pods(world: DraWorld) -> None:
    """KEP-4815, dynamic MIG: the scheduler cuts a 1g device out of the partitionable GPU's
    counters; preparing the claim makes it, with a UUID the slice never had. The container gets
    that UUID; the agent names the claim's device by it (from the CDI spec), and the operator
    matches the pod's process on that MIG device to its allocation."""
    expression = (
        f"device.attributes['{DRIVER}'].profile == '1g.10gb' && "
        f"device.attributes['{DRIVER}'].parentUUID == '{PARTED}'"
    )
    _claim(world, "mig", _request("mig.nvidia.com", expression))
    _pod(world, "mig", claims=("mig",))
    _, pid = _running(world, "mig")
    uid, result = _result(world, "mig")
    assert result["device"].startswith("gpu-3-mig-1g10gb-19-")
    made = dynamic_mig_uuid(PARTED, result["device"], uid)
    assert _visible_devices(pid) == made
    dra = world.node.node.dra
    assert dra is not None
    assert [(m["uuid"], m["claim"]) for m in dra.created_mig_devices()] == [(made, uid)]

    world.hardware.make_mig(PARTED, made, "1g.10gb", 10240)
    world.hardware.put(made, pid, 2048)

    entry = _judged(world, "mig", "ProcessesRunning")
    assert (entry["deviceUUID"], entry["allocatedBy"], entry["allocatedDevices"]) == (
        made,
        ["DRA"],
        [made],
    )
    _published(world, "mig", "mig", result["device"], made)


def test_two_pods_share_one_gpus_memory(world: DraWorld) -> None:
    """KEP-5075: two claims consume 40Gi each of the shared GPU (all of its memory); both pods
    run on it with its UUID, and each is judged on it with the memory it was handed."""
    for name in ("share-a", "share-b"):
        expression = f"device.attributes['{DRIVER}'].uuid == '{SHARED}'"
        capacity = {"capacity": {"requests": {"memory": "40Gi"}}}
        _claim(world, name, _request("gpu.nvidia.com", expression, **capacity))
        _pod(world, name, claims=(name,))
    for name, mib in (("share-a", 1024), ("share-b", 3072)):
        _, pid = _running(world, name)
        _, result = _result(world, name)
        assert (result["device"], result["consumedCapacity"]) == ("gpu-2", {"memory": "40Gi"})
        assert _visible_devices(pid) == SHARED
        world.hardware.put(SHARED, pid, mib)
    for name, mib in (("share-a", 1024), ("share-b", 3072)):
        entry = _judged(world, name, "ProcessesRunning")
        assert (entry["deviceUUID"], entry["allocatedBy"], entry["allocatedDevices"]) == (
            SHARED,
            ["DRA"],
            [SHARED],
        )
        assert (entry["usedMemoryMiB"], entry["handedMemoryMiB"]) == (mib, 40960)
        _published(world, name, name, "gpu-2", SHARED)


def test_a_pod_asking_nvidia_com_gpu_gets_a_gpu_through_dra_and_is_caught_outside_it(
    world: DraWorld,
) -> None:
    """KEP-5004: no device plugin advertises nvidia.com/gpu, so the scheduler serves the pod's
    `nvidia.com/gpu: 1` from the DeviceClass that names it, through a claim it makes for the
    pod. The kubelet starts the container with that GPU's UUID; the pod is judged allocated by
    DRA with the claim's device and, once its process moves to the other GPU, outside it."""
    _pod(world, "whole", gpus=1)
    pod, pid = _running(world, "whole")
    claim = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    _, result = _result(world, claim)
    given = world.node.node.dra_config()["devices"][result["device"]]["uuid"]
    assert given in (WHOLE, SPARE), "the shared GPU is full and the partitionable one cut"
    assert _visible_devices(pid) == given
    world.hardware.put(given, pid, 4096)

    entry = _judged(world, "whole", "ProcessesRunning")
    assert (entry["deviceUUID"], entry["allocatedBy"], entry["allocatedDevices"]) == (
        given,
        ["DRA"],
        [given],
    )
    allocations = {a["name"]: a for a in node_report(world.node)["status"]["allocations"]}
    assert allocations["whole"].get("gpus") == 1, "the claim's GPU, counted once"
    _published(world, "whole", claim, result["device"], given)

    other = SPARE if given == WHOLE else WHOLE
    world.hardware.put(other, pid, 4096)
    entry = _judged(world, "whole", "UsingUnallocatedGPU")
    assert (entry["deviceUUID"], entry["allocatedDevices"]) == (other, [given])
    wait_for_event(world.node, NS, "whole", "UsingUnallocatedGPU")


def test_after_a_kubelet_restart_the_driver_serves_again(world: DraWorld) -> None:
    """The restarted kubelet deletes the node's slices and registers the driver again, which
    publishes them again: a new pod asking `nvidia.com/gpu` gets the last whole GPU and is
    judged on it (its process is new to the agent, which asks the kubelet at once), and the
    pods prepared before keep their claim devices in the kubelet's and the agent's view."""
    node, cluster = world.node.node, world.node.cluster
    node.restart("kubelet")
    node.wait_ready(cluster.binaries.kubectl, cluster.kubeconfig)
    _pod(world, "after", gpus=1)
    pod, pid = _running(world, "after")
    claim = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    _, result = _result(world, claim)
    given = node.dra_config()["devices"][result["device"]]["uuid"]
    whole = world.admin.get(f"/api/v1/namespaces/{NS}/pods/whole")
    first = whole["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    assert given == ({WHOLE, SPARE} - {_uuid_of(world, first)}).pop()
    assert _visible_devices(pid) == given
    world.hardware.put(given, pid, 1024)
    entry = _judged(world, "after", "ProcessesRunning")
    assert (entry["deviceUUID"], entry["allocatedBy"], entry["allocatedDevices"]) == (
        given,
        ["DRA"],
        [given],
    )
    _published(world, "after", claim, result["device"], given)
    assert [d["uuid"] for d in _claim_devices(world, "share-a")] == [SHARED]


def _uuid_of(world: DraWorld, claim: str) -> str:
    _, result = _result(world, claim)
    return str(world.node.node.dra_config()["devices"][result["device"]]["uuid"])
