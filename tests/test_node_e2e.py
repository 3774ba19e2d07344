"""The product on the real node, installed as users install it (`kubectl apply -k` of the
manifests, through the local node's overlay): the agent as its DaemonSet's pod (hostPID, its
pod-bound token, the kubelet's real PodResources socket), the operator as its Deployment, and
real pods of a Deployment whose real processes the scenario names (the GPUs are the only
simulated part). Skipped, with the reason, where the machine cannot run a node."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.node import DEFAULT_SCENARIO, cannot_run_node, running_node
from gpuusage_dev.localcluster.nodeinstall import overlay
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.podresources.kubelet import list_pods
from gpuusage_nodeagent.podresources.wire import list_response
from tests.conftest import wait_for
from tests.test_local_node import _deployment

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "gpu-node-a"
GPUS = [g["uuid"] for g in DEFAULT_SCENARIO["gpus"]]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    why = cannot_run_node(product=True)
    if why is not None:
        pytest.skip(f"this machine cannot run a node: {why}")
    directory = tmp_path_factory.mktemp("node-e2e")
    scenario = directory / "scenario"
    scenario.mkdir()
    world: dict[str, Any] = {"scenario": scenario}
    _scenario(world, {})
    with running_node(directory, NAME, product=True) as (cluster, node):
        folder = overlay(
            directory / "install",
            apiserver_port=int(cluster.server.rsplit(":", 1)[1]),
            scenario_dir=scenario,
            kubelet_root=node.directory / "kubelet",
            agent_args=("--interval", "1"),
        )
        kubectl = [str(cluster.binaries.kubectl), "--kubeconfig", str(cluster.kubeconfig)]
        subprocess.run([*kubectl, "apply", "-k", str(folder)], check=True, capture_output=True)
        api, _ = api_client(cluster.kubeconfig)
        world.update(cluster=cluster, node=node, api=api, core=client.CoreV1Api(api))
        wait_for(lambda: _report(world).get("status"), timeout=90, what="the report reconciled")
        yield world


def _scenario(world: dict[str, Any], processes: dict[str, list[dict[str, int]]]) -> None:
    """The node's GPUs with these processes (device UUID → pid and MiB), written whole."""
    gpus = [
        {**gpu, "processes": processes.get(gpu["uuid"], [])} for gpu in DEFAULT_SCENARIO["gpus"]
    ]
    staged = world["scenario"] / "gpus.new"
    staged.write_text(yaml.safe_dump({"gpus": gpus}))
    staged.replace(world["scenario"] / "gpus.yaml")


def _report(world: dict[str, Any]) -> dict[str, Any]:
    found = client.CustomObjectsApi(world["api"]).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, NAME
    )
    assert isinstance(found, dict)
    return found


def _running(world: dict[str, Any], namespace: str, app: str) -> client.V1Pod | None:
    pods = world["core"].list_namespaced_pod(namespace, label_selector=f"app={app}").items
    ready = [p for p in pods if p.status and p.status.phase == "Running"]
    return ready[0] if ready else None


def _host_pid(world: dict[str, Any], container_id: str) -> int:
    """The container's main process as the host sees it (containerd's task list)."""
    tasks = world["node"].containerd.ctr("tasks", "ls").stdout.decode().splitlines()
    for line in tasks[1:]:
        fields = line.split()
        if fields and fields[0] == container_id:
            return int(fields[1])
    raise AssertionError(f"no task for container {container_id}")


def _condition(pod: client.V1Pod) -> tuple[str, str] | None:
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == names.POD_CONDITION_GPU_IN_USE:
            return str(c.status), str(c.reason)
    return None


def test_a_deployment_pod_is_marked_with_its_real_process_and_then_caught_outside(
    installed: dict[str, Any],
) -> None:
    """The kubelet gave the pod one GPU (read from its real PodResources socket); the scenario
    puts the pod's real pid there: the DaemonSet's agent attributes it through the host's /proc
    and the real cgroup path, the operator marks the pod. Moved to another GPU, the same
    process is outside what the kubelet gave it: UsingUnallocatedGPU."""
    world = installed
    ensure_namespace(world["core"], "ml")
    wait_for(lambda: world["core"].read_namespaced_service_account("default", "ml"), what="SA")
    deployment: Any = _deployment("train", "ml", 1)
    client.AppsV1Api(world["api"]).create_namespaced_deployment("ml", deployment)
    pod = wait_for(lambda: _running(world, "ml", "train"), timeout=90, what="train running")
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    socket = world["node"].directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}[pod.metadata.name]
    (device,) = given.containers[0].devices[0].device_ids
    pid = _host_pid(world, cid)

    _scenario(world, {device: [{"pid": pid, "usedMemoryMiB": 4096}]})

    def marked() -> client.V1Pod | None:
        found = world["core"].read_namespaced_pod(pod.metadata.name, "ml")
        return found if _condition(found) == ("True", "ProcessesRunning") else None

    found = wait_for(marked, timeout=120, what="train marked in use")
    assert found.metadata.annotations[names.ANNOTATION_GPUS] == device
    assert found.metadata.annotations[names.ANNOTATION_GPU_MEMORY_MIB] == "4096"
    (process,) = [
        p for g in _report(world)["spec"]["gpus"] for p in g.get("processes", []) if p["pid"] == pid
    ]
    assert (process["containerID"], process["podUID"]) == (cid, pod.metadata.uid)

    other = next(g for g in GPUS if g != device)
    _scenario(world, {other: [{"pid": pid, "usedMemoryMiB": 4096}]})

    def outside() -> bool:
        found = world["core"].read_namespaced_pod(pod.metadata.name, "ml")
        return _condition(found) == ("True", "UsingUnallocatedGPU")

    wait_for(outside, timeout=120, what="train caught outside its allocation")

    def entries() -> list[dict[str, Any]]:
        listed = _report(world)["status"].get("pods", [])
        return [e for e in listed if e["name"] == pod.metadata.name]

    # the status is written after the pods in the same reconcile: wait for it
    wait_for(lambda: entries() and entries()[0]["deviceUUID"] == other, what="the status")
    assert [(e["deviceUUID"], e.get("unallocated")) for e in entries()] == [(other, True)]
    assert json.dumps(entries()[0].get("allocatedDevices")) == json.dumps([device])


def test_a_pod_without_a_request_using_a_gpu_is_flagged(installed: dict[str, Any]) -> None:
    """A real pod that asked for no GPU (its container has every GPU, as with
    NVIDIA_VISIBLE_DEVICES=all) runs on one: UsingUnrequestedGPU, with its Warning Event."""
    world = installed
    ensure_namespace(world["core"], "lab")
    wait_for(lambda: world["core"].read_namespaced_service_account("default", "lab"), what="SA")
    deployment: Any = _deployment("sneaky", "lab", 0)
    deployment["spec"]["template"]["spec"]["containers"][0].pop("resources")
    client.AppsV1Api(world["api"]).create_namespaced_deployment("lab", deployment)
    pod = wait_for(lambda: _running(world, "lab", "sneaky"), timeout=90, what="sneaky running")
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    _scenario(world, {GPUS[-1]: [{"pid": _host_pid(world, cid), "usedMemoryMiB": 2048}]})

    def flagged() -> bool:
        found = world["core"].read_namespaced_pod(pod.metadata.name, "lab")
        return _condition(found) == ("True", "UsingUnrequestedGPU")

    wait_for(flagged, timeout=120, what="sneaky flagged")
    # read raw: the kubelet's and scheduler's events have no eventTime, which the client's
    # events.k8s.io model refuses
    raw: Any = client.EventsV1Api(world["api"]).list_namespaced_event("lab", _preload_content=False)
    events = json.loads(raw.data)["items"]
    assert "UsingUnrequestedGPU" in {
        e.get("reason") for e in events if e["regarding"].get("name") == pod.metadata.name
    }
