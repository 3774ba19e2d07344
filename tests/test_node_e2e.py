"""The product on the real node, installed as users install it (`kubectl apply -k` of the
manifests, through the local node's overlay): the agent as its DaemonSet's pod (hostPID, its
pod-bound token, the kubelet's real PodResources socket), the operator as its Deployment, and
real pods of a Deployment whose real processes the scenario names (the GPUs are the only
simulated part). Skipped, with the reason, where the machine cannot run a node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.node import (
    DEFAULT_SCENARIO,
)
from gpuusage_dev.localcluster.workloads import gpu_job, sleeper_deployment
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.podresources.kubelet import list_pods
from gpuusage_nodeagent.podresources.wire import list_response
from tests.conftest import CHART, Helm, token_config, wait_for
from tests.examples import empty_report
from tests.nodeworld import (
    NAME,
    NodeWorld,
    chart_values,
    component,
    event_reasons,
    gpu_condition,
    host_pid,
    installed_world,
    node_report,
    running_pod,
    token_of,
    wait_for_event,
    write_node_scenario,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

GPUS = [g["uuid"] for g in DEFAULT_SCENARIO["gpus"]]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeWorld]:
    yield from installed_world(tmp_path_factory.mktemp("node-e2e"))


def _condition(pod: client.V1Pod) -> tuple[str, str] | None:
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == names.POD_CONDITION_GPU_IN_USE:
            return str(c.status), str(c.reason)
    return None


def test_a_deployment_pod_is_marked_with_its_real_process_and_then_caught_outside(
    installed: NodeWorld,
) -> None:
    """The kubelet gave the pod one GPU (read from its real PodResources socket); the scenario
    puts the pod's real pid there: the DaemonSet's agent attributes it through the host's /proc
    and the real cgroup path, the operator marks the pod. Moved to another GPU, the same
    process is outside what the kubelet gave it: UsingUnallocatedGPU."""
    world = installed
    ensure_namespace(world.core, "ml")
    wait_for(lambda: world.core.read_namespaced_service_account("default", "ml"), what="SA")
    deployment: Any = sleeper_deployment("train", "ml", 1)
    client.AppsV1Api(world.api).create_namespaced_deployment("ml", deployment)
    pod = wait_for(lambda: running_pod(world, "ml", "train"), timeout=90, what="train running")
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    socket = world.node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}[pod.metadata.name]
    (device,) = given.containers[0].devices[0].device_ids
    pid = host_pid(world, cid)

    write_node_scenario(world, {device: [{"pid": pid, "usedMemoryMiB": 4096}]})

    def marked() -> client.V1Pod | None:
        found = world.core.read_namespaced_pod(pod.metadata.name, "ml")
        return found if _condition(found) == ("True", "ProcessesRunning") else None

    found = wait_for(marked, timeout=120, what="train marked in use")
    assert found.metadata.annotations[names.ANNOTATION_GPUS] == device
    assert found.metadata.annotations[names.ANNOTATION_GPU_MEMORY_MIB] == "4096"
    (process,) = [
        p
        for g in node_report(world)["spec"]["gpus"]
        for p in g.get("processes", [])
        if p["pid"] == pid
    ]
    assert (process["containerID"], process["podUID"]) == (cid, pod.metadata.uid)

    other = next(g for g in GPUS if g != device)
    write_node_scenario(world, {other: [{"pid": pid, "usedMemoryMiB": 4096}]})

    def outside() -> bool:
        found = world.core.read_namespaced_pod(pod.metadata.name, "ml")
        return _condition(found) == ("True", "UsingUnallocatedGPU")

    wait_for(outside, timeout=120, what="train caught outside its allocation")

    def entries() -> list[dict[str, Any]]:
        listed = node_report(world)["status"].get("pods", [])
        return [e for e in listed if e["name"] == pod.metadata.name]

    # the status is written after the pods in the same reconcile: wait for it
    wait_for(lambda: entries() and entries()[0]["deviceUUID"] == other, what="the status")
    assert [(e["deviceUUID"], e.get("unallocated")) for e in entries()] == [(other, True)]
    assert json.dumps(entries()[0].get("allocatedDevices")) == json.dumps([device])


def test_a_pod_without_a_request_using_a_gpu_is_flagged(installed: NodeWorld) -> None:
    """A real pod that asked for no GPU (its container has every GPU, as with
    NVIDIA_VISIBLE_DEVICES=all) runs on one: UsingUnrequestedGPU, with its Warning Event."""
    world = installed
    ensure_namespace(world.core, "lab")
    wait_for(lambda: world.core.read_namespaced_service_account("default", "lab"), what="SA")
    deployment: Any = sleeper_deployment("sneaky", "lab", 0)
    client.AppsV1Api(world.api).create_namespaced_deployment("lab", deployment)
    pod = wait_for(lambda: running_pod(world, "lab", "sneaky"), timeout=90, what="sneaky running")
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    write_node_scenario(world, {GPUS[-1]: [{"pid": host_pid(world, cid), "usedMemoryMiB": 2048}]})

    def flagged() -> bool:
        found = world.core.read_namespaced_pod(pod.metadata.name, "lab")
        return _condition(found) == ("True", "UsingUnrequestedGPU")

    wait_for(flagged, timeout=120, what="sneaky flagged")
    wait_for_event(world, "lab", pod.metadata.name, "UsingUnrequestedGPU")


def _in_use(world: NodeWorld, namespace: str, app: str, gpus: int = 1) -> dict[str, Any]:
    """A Deployment's running pod with `gpus` GPUs whose real process the scenario puts on the
    device the kubelet gave it, marked ProcessesRunning: its pod, device, pid, container ID."""
    ensure_namespace(world.core, namespace)
    wait_for(lambda: world.core.read_namespaced_service_account("default", namespace), what="SA")
    deployment: Any = sleeper_deployment(app, namespace, gpus)
    client.AppsV1Api(world.api).create_namespaced_deployment(namespace, deployment)
    pod = wait_for(lambda: running_pod(world, namespace, app), timeout=90, what=f"{app} running")
    return _put_on_its_device(world, pod)


def _put_on_its_device(world: NodeWorld, pod: Any) -> dict[str, Any]:
    namespace, name = pod.metadata.namespace, pod.metadata.name
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    socket = world.node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}[name]
    (device,) = given.containers[0].devices[0].device_ids
    pid = host_pid(world, cid)
    write_node_scenario(world, {device: [{"pid": pid, "usedMemoryMiB": 1024}]})

    def marked() -> bool:
        found = gpu_condition(world, namespace, name)
        return found is not None and (found["status"], found["reason"]) == (
            "True",
            "ProcessesRunning",
        )

    wait_for(marked, timeout=120, what=f"{name} marked in use")
    wait_for_event(world, namespace, name, "GPUUseStarted")  # later counts see it
    return {"pod": pod, "device": device, "pid": pid, "cid": cid}


def _remove(world: NodeWorld, app: str) -> None:
    """Delete the Deployment `app` (in its namespace of the same name): its GPU goes back."""
    client.AppsV1Api(world.api).delete_namespaced_deployment(app, app)
    wait_for(lambda: not world.core.list_namespaced_pod(app).items, timeout=90, what="gone")
    write_node_scenario(world, {})


def _status_pods(world: NodeWorld) -> list[dict[str, Any]]:
    return list(node_report(world).get("status", {}).get("pods", []))


def test_a_jobs_pod_is_marked_and_unmarked_when_its_work_ends(installed: NodeWorld) -> None:
    """A Job's pod (restartPolicy Never) runs on its GPU: marked; its process ends, the driver
    lists it no more, the Job completes: the marks go, use ended, nothing left in the status."""
    world = installed
    ensure_namespace(world.core, "batch")
    wait_for(lambda: world.core.read_namespaced_service_account("default", "batch"), what="SA")
    # the work: until told to finish (SIGTERM), then success
    job: Any = gpu_job("epoch", "batch", ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"])
    client.BatchV1Api(world.api).create_namespaced_job("batch", job)
    pod = wait_for(lambda: running_pod(world, "batch", "epoch"), timeout=90, what="epoch running")
    used = _put_on_its_device(world, pod)
    name = pod.metadata.name
    assert (
        world.core.read_namespaced_pod(name, "batch").metadata.annotations[names.ANNOTATION_GPUS]
        == used["device"]
    )

    os.kill(used["pid"], signal.SIGTERM)
    write_node_scenario(world, {})

    def complete() -> bool:
        status: Any = client.BatchV1Api(world.api).read_namespaced_job_status("epoch", "batch")
        return bool(status.status.succeeded)

    wait_for(complete, timeout=90, what="the Job complete")

    def ended() -> bool:
        found = gpu_condition(world, "batch", name)
        return found is not None and (found["status"], found["reason"]) == (
            "False",
            "ProcessesEnded",
        )

    wait_for(ended, timeout=120, what="use ended")
    annotations = world.core.read_namespaced_pod(name, "batch").metadata.annotations or {}
    assert names.ANNOTATION_GPUS not in annotations
    assert [e for e in _status_pods(world) if e["name"] == name] == []
    assert wait_for_event(world, "batch", name, "GPUUseEnded").count("GPUUseStarted") == 1


def test_a_pod_deleted_by_its_controller_loses_its_marks(installed: NodeWorld) -> None:
    """The Deployment scaled to zero: the ReplicaSet deletes the pod, the kubelet kills its
    process (the driver lists it no more): the report's status forgets the pod."""
    world = installed
    used = _in_use(world, "shrink", "shrink")
    uid = used["pod"].metadata.uid
    # the status is written after the pod in the same reconcile: wait for it
    wait_for(
        lambda: [e["uid"] for e in _status_pods(world) if e["namespace"] == "shrink"] == [uid],
        what="the status listing the pod",
    )
    client.AppsV1Api(world.api).patch_namespaced_deployment_scale(
        "shrink", "shrink", {"spec": {"replicas": 0}}
    )
    wait_for(
        lambda: not world.core.list_namespaced_pod("shrink").items,
        timeout=90,
        what="the pod deleted",
    )
    write_node_scenario(world, {})
    # the operator forgets the pod as soon as its index loses it, which may come before the
    # agent's next report: wait for each on its own
    wait_for(
        lambda: all(
            p.get("podUID") != uid
            for g in node_report(world)["spec"]["gpus"]
            for p in g.get("processes", [])
        ),
        timeout=60,
        what="the agent's report without the pod's process",
    )
    wait_for(
        lambda: not [e for e in _status_pods(world) if e["namespace"] == "shrink"],
        timeout=60,
        what="the status without the pod",
    )


def test_a_real_container_restart_is_continuous_use(installed: NodeWorld) -> None:
    """The container's process killed: the kubelet starts the container again under a new ID
    (restartCount 1). The driver drops the old process at once and lists the new one on the
    same device: the pod's condition never changed, no Event pair, the report attributes the
    new process to the same pod through its new container ID."""
    world = installed
    used = _in_use(world, "crashy", "crashy")
    name = used["pod"].metadata.name
    before = gpu_condition(world, "crashy", name)
    write_node_scenario(world, {})  # the driver lists a process until it exits
    os.kill(used["pid"], signal.SIGKILL)

    def restarted() -> str | None:
        found = world.core.read_namespaced_pod(name, "crashy")
        status = found.status.container_statuses[0]
        cid = status.container_id.split("://", 1)[1] if status.container_id else None
        fresh = status.restart_count == 1 and status.state.running and cid != used["cid"]
        return str(cid) if fresh else None

    cid = wait_for(restarted, timeout=90, what="the container restarted by the kubelet")
    pid = host_pid(world, cid)
    write_node_scenario(world, {used["device"]: [{"pid": pid, "usedMemoryMiB": 1024}]})

    def attributed() -> bool:
        listed = [p for g in node_report(world)["spec"]["gpus"] for p in g.get("processes", [])]
        return [(p["pid"], p.get("containerID"), p.get("podUID")) for p in listed] == [
            (pid, cid, used["pod"].metadata.uid)
        ]

    wait_for(attributed, timeout=60, what="the new process attributed")
    # (the status has every pid at once; the pod's detail follows at its own pace)
    wait_for(
        lambda: (
            pid
            in [
                listed
                for p in (node_report(world).get("status") or {}).get("pods") or []
                if p["uid"] == used["pod"].metadata.uid
                for c in p.get("containers") or []
                for listed in c.get("pids") or []
            ]
        ),
        timeout=60,
        what="the status naming the new process",
    )
    assert event_reasons(world, "crashy", name).count("GPUUseStarted") == 1
    assert "GPUUseEnded" not in event_reasons(world, "crashy", name)
    assert gpu_condition(world, "crashy", name) == before
    _remove(world, "crashy")


def test_the_agents_pod_recreated_by_its_daemonset_loses_nothing(
    installed: NodeWorld,
) -> None:
    """The agent's pod deleted: its DaemonSet starts another, which reads the same node and
    republishes; the pod in use keeps its condition (same transition time), no Event says its
    use ended or started again, and the report never went stale."""
    world = installed
    used = _in_use(world, "keep", "keep")
    name = used["pod"].metadata.name
    before = gpu_condition(world, "keep", name)
    stale_before = _stale_condition(world)
    (agent,) = world.core.list_namespaced_pod(
        "gpuusage-system", label_selector="app.kubernetes.io/name=gpuusage-agent"
    ).items
    world.core.delete_namespaced_pod(agent.metadata.name, "gpuusage-system")

    def replaced() -> client.V1Pod | None:
        pods = world.core.list_namespaced_pod(
            "gpuusage-system", label_selector="app.kubernetes.io/name=gpuusage-agent"
        ).items
        fresh = [
            p for p in pods if p.metadata.uid != agent.metadata.uid and p.status.phase == "Running"
        ]
        return fresh[0] if fresh else None

    new = wait_for(replaced, timeout=90, what="the DaemonSet's new agent pod")
    started = new.status.container_statuses[0].state.running.started_at

    def republished() -> bool:
        observed = node_report(world)["spec"]["observedAt"]
        return bool(datetime.fromisoformat(observed.replace("Z", "+00:00")) > started)

    wait_for(republished, timeout=60, what="a report from the new agent")
    after = gpu_condition(world, "keep", name)
    assert after == before
    assert event_reasons(world, "keep", name).count("GPUUseStarted") == 1
    assert "GPUUseEnded" not in event_reasons(world, "keep", name)
    assert _stale_condition(world) == stale_before
    _remove(world, "keep")


def _stale_condition(world: NodeWorld) -> dict[str, Any]:
    conditions = node_report(world)["status"].get("conditions", [])
    (stale,) = [c for c in conditions if c["type"] == "Stale"]
    return {k: stale[k] for k in ("status", "reason", "lastTransitionTime")}


def _kubectl(world: NodeWorld, *args: str, timeout: float = 180) -> str:
    cluster = world.cluster
    done = subprocess.run(
        [str(cluster.binaries.kubectl), "--kubeconfig", str(cluster.kubeconfig), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.stdout


def _lease_renewed(world: NodeWorld) -> Any:
    """When the agent last renewed its node's Lease: it vouches for an unchanged report."""
    lease: Any = client.CoordinationV1Api(world.api).read_namespaced_lease(NAME, "gpuusage-system")
    return lease.spec.renew_time


def _node_ready(world: NodeWorld) -> str:
    node = world.core.read_node(NAME)
    return str(next(c.status for c in node.status.conditions if c.type == "Ready"))


def test_the_kubelet_stopped_leaves_the_truth_in_place(installed: NodeWorld) -> None:
    """The kubelet stops (a crash, `systemctl stop kubelet`): the node goes NotReady, but its
    containers, the agent among them, run on. The agent says the kubelet cannot be read; the
    pod whose process still runs stays marked in use (true), and with its allocation unknown
    nothing calls it outside its allocation. The kubelet back: Ready, read again."""
    world = installed
    used = _in_use(world, "steady", "steady")
    name = used["pod"].metadata.name
    before = gpu_condition(world, "steady", name)
    world.node.stop_kubelet()
    try:
        wait_for(lambda: _node_ready(world) != "True", timeout=120, what="the node NotReady")
        wait_for(
            lambda: node_report(world)["spec"].get("kubelet", {}).get("state") == "Unavailable",
            timeout=60,
            what="the agent saying the kubelet is unavailable",
        )
        renewed = _lease_renewed(world)
        wait_for(lambda: _lease_renewed(world) != renewed, timeout=60, what="the Lease renewed")
        assert gpu_condition(world, "steady", name) == before
        assert _stale_condition(world)["status"] == "False"
    finally:
        world.node.start_kubelet()
    wait_for(lambda: _node_ready(world) == "True", timeout=120, what="the node Ready again")
    wait_for(
        lambda: node_report(world)["spec"].get("kubelet", {}).get("state") == "Read",
        timeout=60,
        what="the kubelet read again",
    )
    assert gpu_condition(world, "steady", name) == before
    assert "GPUUseEnded" not in event_reasons(world, "steady", name)
    _remove(world, "steady")


def test_the_node_drained_and_cordoned(installed: NodeWorld) -> None:
    """`kubectl drain`: the GPU pods are evicted (their processes end with them), the
    operator's pod too; the agent's DaemonSet pod stays and keeps publishing. Uncordoned, the
    operator comes back and the report's status has no pod that was evicted; the new pods,
    which use no GPU yet, carry no marks."""
    world = installed
    used = _in_use(world, "drained", "drained")
    old_uid = used["pod"].metadata.uid
    agents = world.core.list_namespaced_pod(
        "gpuusage-system", label_selector="app.kubernetes.io/name=gpuusage-agent"
    ).items
    _kubectl(
        world, "drain", NAME, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s"
    )
    try:
        write_node_scenario(world, {})  # every GPU process was in an evicted pod
        assert world.core.read_node(NAME).spec.unschedulable is True
        left = world.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NAME}")
        running = [p for p in left.items if p.status.phase == "Running"]
        assert {p.metadata.namespace for p in running} == {"gpuusage-system"}
        assert {p.metadata.uid for p in running} == {p.metadata.uid for p in agents}
        renewed = _lease_renewed(world)
        wait_for(lambda: _lease_renewed(world) != renewed, timeout=60, what="the Lease renewed")
    finally:
        _kubectl(world, "uncordon", NAME)
    new = wait_for(lambda: running_pod(world, "drained", "drained"), timeout=120, what="back")
    assert new.metadata.uid != old_uid
    wait_for(
        lambda: not [e for e in _status_pods(world) if e["uid"] == old_uid],
        timeout=120,
        what="the evicted pod gone from the status",
    )
    assert gpu_condition(world, "drained", new.metadata.name) is None
    annotations = world.core.read_namespaced_pod(new.metadata.name, "drained").metadata
    assert names.ANNOTATION_GPUS not in (annotations.annotations or {})


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_the_real_pods_hold_only_the_rights_the_readme_promises(
    installed: NodeWorld, tmp_path: Path
) -> None:
    """The DaemonSet's agent and the Deployment's operator as the kernel runs them: the user
    their manifests name, no capability, no privilege escalation, a read-only root; and their
    real projected tokens (read from their containers) allowed what the README's table says
    and refused the rest: the agent's held to its own node's report and Lease."""
    world = installed
    group = (names.GROUP, names.VERSION, names.PLURAL)
    apis: dict[str, client.ApiClient] = {}
    for name in ("agent", "operator"):
        pod, pid = component(world, name)
        status = _proc_status(pid)
        wanted = pod.spec.security_context.run_as_user
        assert status["Uid"].split()[:2] == [str(wanted)] * 2, name
        assert status["CapEff"] == "0000000000000000", name
        assert status["NoNewPrivs"] == "1", name
        root = next(
            line.split()
            for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            if line.split()[4] == "/"
        )
        assert "ro" in root[5].split(","), f"{name}'s root filesystem is read-only"
        token = token_of(pid)
        config = token_config(world.cluster, name, token, tmp_path / f"{name}.kubeconfig")
        apis[name], _ = api_client(config)
    agent = client.CustomObjectsApi(apis["agent"])
    agent.patch_cluster_custom_object(*group, NAME, {"metadata": {}})  # its own: allowed
    refusals: dict[str, Callable[[], Any]] = {
        "another node's report": lambda: agent.create_cluster_custom_object(
            *group, {**empty_report("other-node")}
        ),
        "its report's status": lambda: agent.patch_cluster_custom_object_status(
            *group, NAME, {"status": {}}
        ),
        "deleting its report": lambda: agent.delete_cluster_custom_object(*group, NAME),
        "secrets (agent)": lambda: client.CoreV1Api(apis["agent"]).list_namespaced_secret(
            "gpuusage-system"
        ),
        "a pod (agent)": lambda: client.CoreV1Api(apis["agent"]).patch_namespaced_pod(
            "x", "default", {"metadata": {}}
        ),
        "a report's spec (operator)": lambda: client.CustomObjectsApi(
            apis["operator"]
        ).patch_cluster_custom_object(*group, NAME, {"spec": {"gpus": []}}),
        "deleting a pod (operator)": lambda: client.CoreV1Api(
            apis["operator"]
        ).delete_collection_namespaced_pod("default"),
        "secrets (operator)": lambda: client.CoreV1Api(apis["operator"]).list_namespaced_secret(
            "gpuusage-system"
        ),
    }
    allowed = []
    for what, call in refusals.items():
        try:
            call()
        except client.ApiException as exc:
            if exc.status in (403, 422):
                continue
            raise
        allowed.append(what)
    assert allowed == [], f"allowed: {allowed}"
    client.CustomObjectsApi(apis["operator"]).get_cluster_custom_object(*group, NAME)


def test_the_chart_installs_on_the_node_as_the_manifests_did(
    installed: NodeWorld, helm_binary: Path, tmp_path: Path
) -> None:
    """The manifests' install removed (`kubectl delete -k`), the chart installed with `helm
    install` in its place, its values doing what the local node's overlay did: its agent and
    operator mark a real pod from its real process."""
    world = installed
    cluster = world.cluster
    _kubectl(world, "delete", "-k", str(world.install), "--wait=true", timeout=240)

    def namespace_gone() -> bool:
        listed = world.core.list_namespace().items
        return "gpuusage-system" not in {n.metadata.name for n in listed}

    wait_for(namespace_gone, timeout=120, what="the namespace gone")
    values = chart_values(cluster, world.node, world.scenario)
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    helm = Helm(helm_binary, tmp_path / "helm", cluster.kubeconfig)
    helm.run(
        "install", "gpuusage", str(CHART), "-n", "gpuusage-system", "--create-namespace",
        "-f", str(file), "--wait", "--timeout", "180s",
    )  # fmt: skip
    daemonset: Any = client.AppsV1Api(world.api).read_namespaced_daemon_set(
        "gpuusage-agent", "gpuusage-system"
    )
    assert daemonset.metadata.annotations["meta.helm.sh/release-name"] == "gpuusage"
    wait_for(lambda: node_report(world).get("status"), timeout=90, what="the chart's report")
    used = _in_use(world, "charted", "charted")
    found = world.core.read_namespaced_pod(used["pod"].metadata.name, "charted")
    assert found.metadata.annotations[names.ANNOTATION_GPUS] == used["device"]
