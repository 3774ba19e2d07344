"""The real node with the product installed, as the node tests share it: a typed world (the
node, its control plane, the API clients, the scenario the GPUs read) and what the tests ask of
it. Skipped, with the reason, where the machine cannot run a node."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Collection, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.localcluster.node import (
    DEFAULT_SCENARIO,
    GpuAllocation,
    Node,
    cannot_run_node,
    running_node,
    write_scenario,
)
from gpuusage_dev.localcluster.nodeinstall import SCENARIO_MOUNT, overlay
from tests.conftest import wait_for

NAME = "gpu-node-a"
"""The node's name (and its report's)."""


@dataclass(frozen=True)
class NodeWorld:
    """What the node tests share: the product installed on the real node."""

    scenario: Path
    """The folder of the scenario the agent's simulated GPUs read."""
    cluster: LocalCluster
    node: Node
    api: client.ApiClient
    core: Any
    """A client.CoreV1Api. Typed Any: its models make every field optional, and the tests read
    them as the apiserver fills them."""
    install: Path
    """The kustomize folder the product was installed from."""


def installed_world(
    directory: Path,
    *,
    base: str = "manifests",
    agent_args: tuple[str, ...] = ("--interval", "1"),
    operator_args: tuple[str, ...] = (),
    gpus: dict[str, Any] = DEFAULT_SCENARIO,
    gpu_allocation: GpuAllocation = "device-plugin",
    shared: Collection[str] = (),
    partitionable: Collection[str] = (),
) -> Generator[NodeWorld, None, None]:
    """The real node with the product installed by `kubectl apply -k` of `base` through the
    local node's overlay: the world the tests share (skipped where no node can run). `gpus`:
    the node's GPU scenario; `gpu_allocation`, `shared`, `partitionable`: who hands them out
    and how (localcluster.node.Node)."""
    why = cannot_run_node(product=True)
    if why is not None:
        pytest.skip(f"this machine cannot run a node: {why}")
    scenario = directory / "scenario"
    scenario.mkdir()
    write_scenario(scenario, {}, gpus)
    with running_node(
        directory,
        NAME,
        product=True,
        scenario=gpus,
        gpu_allocation=gpu_allocation,
        shared=shared,
        partitionable=partitionable,
    ) as (cluster, node):
        folder = overlay(
            directory / "install",
            apiserver_port=int(cluster.server.rsplit(":", 1)[1]),
            scenario_dir=scenario,
            kubelet_root=node.directory / "kubelet",
            agent_args=agent_args,
            operator_args=operator_args,
            base=base,
        )
        kubectl = [str(cluster.binaries.kubectl), "--kubeconfig", str(cluster.kubeconfig)]
        subprocess.run([*kubectl, "apply", "-k", str(folder)], check=True, capture_output=True)
        api, _ = api_client(cluster.kubeconfig)
        world = NodeWorld(scenario, cluster, node, api, client.CoreV1Api(api), folder)
        wait_for(lambda: node_report(world).get("status"), timeout=90, what="the report reconciled")
        yield world
        # The product's and the tests' requests (the gauge would count the controllers' too)
        deprecated = cluster.deprecated_requests_audited()
        assert not deprecated, f"deprecated APIs requested: {'; '.join(deprecated)}"


def chart_values(cluster: LocalCluster, node: Node, scenario: Path) -> dict[str, Any]:
    """The chart's values that do on the local node what its kustomize overlay does
    (localcluster.nodeinstall): the agent reads the scenario's GPUs, both components reach the
    apiserver on loopback, the PodResources socket is the node's own."""
    api_env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": cluster.server.rsplit(":", 1)[1]},
    ]
    return {
        "agent": {
            "hostNetwork": True,
            "interval": 1,
            "extraArgs": [f"--gpu-source=fake:{SCENARIO_MOUNT}/gpus.yaml"],
            "extraEnv": api_env,
            "extraVolumes": [{"name": "scenario", "hostPath": {"path": str(scenario)}}],
            "extraVolumeMounts": [
                {"name": "scenario", "mountPath": SCENARIO_MOUNT, "readOnly": True}
            ],
            "podResources": {"hostPath": str(node.directory / "kubelet" / "pod-resources")},
        },
        "operator": {"hostNetwork": True, "replicas": 1, "extraEnv": api_env},
    }


def write_node_scenario(world: NodeWorld, processes: dict[str, list[dict[str, int]]]) -> None:
    """The node's GPUs with these processes (device UUID → pid and MiB): the GPUs of the
    scenario the world was installed with, every field of each kept (a `minorNumber`, by which
    the fake driver holds its device files)."""
    write_scenario(world.scenario, processes, world.node.scenario)


def node_report(world: NodeWorld) -> dict[str, Any]:
    found = client.CustomObjectsApi(world.api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, NAME
    )
    assert isinstance(found, dict)
    return found


def running_pod(world: NodeWorld, namespace: str, app: str) -> client.V1Pod | None:
    pods = world.core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
    ready = [p for p in pods if p.status and p.status.phase == "Running"]
    return ready[0] if ready else None


def host_pid(world: NodeWorld, container_id: str) -> int:
    return int(world.node.host_pid(container_id))


def event_reasons(world: NodeWorld, namespace: str, pod: str) -> list[str]:
    """The reasons of the pod's Events, oldest first (read raw: the kubelet's and scheduler's
    have no eventTime, which the client's events.k8s.io model refuses)."""
    raw: Any = client.EventsV1Api(world.api).list_namespaced_event(
        namespace, _preload_content=False
    )
    items = [e for e in json.loads(raw.data)["items"] if e["regarding"].get("name") == pod]
    items.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [str(e.get("reason")) for e in items]


def wait_for_event(world: NodeWorld, namespace: str, pod: str, reason: str) -> list[str]:
    """The pod's Event reasons once one is `reason`. The operator records a transition's
    Event after the write it announces (a condition, a scale), so seeing that write does not
    mean the Event is in yet."""

    def recorded() -> list[str] | None:
        found = event_reasons(world, namespace, pod)
        return found if reason in found else None

    return list(wait_for(recorded, timeout=60, what=f"the {reason} Event on {namespace}/{pod}"))


def gpu_condition(world: NodeWorld, namespace: str, pod: str) -> dict[str, Any] | None:
    raw: Any = world.core.read_namespaced_pod_status(pod, namespace, _preload_content=False)
    conditions = json.loads(raw.data)["status"].get("conditions") or []
    found = [c for c in conditions if c["type"] == names.POD_CONDITION_GPU_IN_USE]
    return found[0] if found else None


def token_of(pid: int) -> str:
    """The projected token the kubelet mounted into the process's container (found by its
    mount point: the image may have /var/run as a link to /run)."""
    mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    (point,) = [
        m.split()[4]
        for m in mounts
        if m.split()[4].endswith("/secrets/kubernetes.io/serviceaccount")
    ]
    return Path(f"/proc/{pid}/root{point}/token").read_text()


def component(world: NodeWorld, name: str) -> tuple[Any, int]:
    """The running pod of gpuusage-`name` and its container's main process on the host."""
    pods = world.core.list_namespaced_pod(
        "gpuusage-system", label_selector=f"app.kubernetes.io/name=gpuusage-{name}"
    ).items
    (pod,) = [p for p in pods if p.status.phase == "Running"]
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    return pod, host_pid(world, cid)
