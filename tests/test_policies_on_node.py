"""Enforced policies on the real node, with the real controllers: an idle notebook Deployment
scaled to zero (its ReplicaSet controller deletes the pod), a Job suspended (its controller
deletes the running pod), an eviction a PodDisruptionBudget refuses not forced. The product is
installed with manifests/overlays/policy-actions (the rights these actions need)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.workloads import gpu_job, sleeper_deployment
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.podresources.kubelet import list_pods
from gpuusage_nodeagent.podresources.wire import list_response
from tests.conftest import token_config, wait_for
from tests.nodeworld import (
    NAME,
    NodeWorld,
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
from tests.worldview import create_policy, in_namespace

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeWorld]:
    yield from installed_world(
        tmp_path_factory.mktemp("node-policies"),
        base="manifests/overlays/policy-actions",
        agent_args=("--interval", "1", "--idle-window", "1"),
        operator_args=("--idle-after=3", "--policy-notice=2"),
    )


def _policy(world: NodeWorld, namespace: str, rule: dict[str, Any]) -> None:
    rules = [{"after": "1s", "mode": "Enforce", **rule}]
    create_policy(
        world.api, namespace, {"namespaceSelector": in_namespace(namespace), "rules": rules}
    )


def _decisions(world: NodeWorld, name: str) -> list[str]:
    body: Any = client.CustomObjectsApi(world.api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, name
    )
    return [d["outcome"] for d in (body.get("status") or {}).get("decisions") or []]


def _namespace(world: NodeWorld, namespace: str) -> None:
    ensure_namespace(world.core, namespace)
    wait_for(lambda: world.core.read_namespaced_service_account("default", namespace), what="SA")


def _idle_on_its_device(world: NodeWorld, pod: Any) -> str:
    """The pod's real process holds 8 GiB of the GPU the kubelet gave it and computes nothing;
    its device."""
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    socket = world.node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}[pod.metadata.name]
    (device,) = given.containers[0].devices[0].device_ids
    held = {"pid": host_pid(world, cid), "usedMemoryMiB": 8192, "smUtil": 0}
    write_node_scenario(world, {device: [held]})
    return str(device)


def _reason(world: NodeWorld, namespace: str, name: str) -> str | None:
    found = gpu_condition(world, namespace, name)
    return None if found is None else str(found["reason"])


def test_an_idle_notebook_deployment_is_scaled_to_zero(installed: NodeWorld) -> None:
    world = installed
    _namespace(world, "nb")
    deployment: Any = sleeper_deployment("notebook", "nb", 1)
    client.AppsV1Api(world.api).create_namespaced_deployment("nb", deployment)
    pod = wait_for(lambda: running_pod(world, "nb", "notebook"), timeout=90, what="running")
    name = pod.metadata.name
    _idle_on_its_device(world, pod)
    wait_for(lambda: _reason(world, "nb", name) == "HoldingIdleGPU", timeout=60, what="idle")
    _policy(world, "nb", {"finding": "HoldingIdleGPU", "action": "ScaleToZero"})

    def scaled() -> bool:
        found: Any = client.AppsV1Api(world.api).read_namespaced_deployment("notebook", "nb")
        return bool(found.spec.replicas == 0)

    wait_for(scaled, timeout=90, what="the Deployment scaled to zero")
    wait_for(
        lambda: not world.core.list_namespaced_pod("nb").items,
        timeout=90,
        what="the ReplicaSet controller deleting the pod",
    )
    write_node_scenario(world, {})  # its process went with it
    assert "GPUPolicyPending" in wait_for_event(world, "nb", name, "GPUPolicyActed")
    wait_for(lambda: "Done" in _decisions(world, "nb"), what="the decision in the status")


def test_an_idle_job_is_suspended(installed: NodeWorld) -> None:
    world = installed
    _namespace(world, "batch")
    job: Any = gpu_job("epoch", "batch", ["/bin/sleep", "3600"])
    client.BatchV1Api(world.api).create_namespaced_job("batch", job)
    pod = wait_for(lambda: running_pod(world, "batch", "epoch"), timeout=90, what="running")
    _idle_on_its_device(world, pod)
    wait_for(
        lambda: _reason(world, "batch", pod.metadata.name) == "HoldingIdleGPU",
        timeout=60,
        what="idle",
    )
    _policy(world, "batch", {"finding": "HoldingIdleGPU", "action": "Suspend"})

    def suspended() -> bool:
        found: Any = client.BatchV1Api(world.api).read_namespaced_job("epoch", "batch")
        return bool(found.spec.suspend)

    wait_for(suspended, timeout=90, what="the Job suspended")
    wait_for(
        lambda: (
            not [
                p
                for p in world.core.list_namespaced_pod("batch").items
                if p.status.phase == "Running"
            ]
        ),
        timeout=90,
        what="the Job controller stopping its pod",
    )
    write_node_scenario(world, {})
    wait_for(lambda: "Done" in _decisions(world, "batch"), what="the decision in the status")


def test_an_eviction_a_disruption_budget_refuses_is_not_forced(installed: NodeWorld) -> None:
    world = installed
    _namespace(world, "lab")
    deployment: Any = sleeper_deployment("sneaky", "lab", 0)
    client.AppsV1Api(world.api).create_namespaced_deployment("lab", deployment)
    budget = client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="sneaky"),
        spec=client.V1PodDisruptionBudgetSpec(
            min_available=1, selector=client.V1LabelSelector(match_labels={"app": "sneaky"})
        ),
    )
    client.PolicyV1Api(world.api).create_namespaced_pod_disruption_budget("lab", budget)
    pod = wait_for(lambda: running_pod(world, "lab", "sneaky"), timeout=90, what="running")
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    gpu = "GPU-44440000-0000-4000-8000-000000000003"
    write_node_scenario(
        world, {gpu: [{"pid": host_pid(world, cid), "usedMemoryMiB": 2048, "smUtil": 50}]}
    )
    name = pod.metadata.name
    wait_for(lambda: _reason(world, "lab", name) == "UsingUnrequestedGPU", what="flagged")
    _policy(world, "lab", {"finding": "UsingUnrequestedGPU", "action": "Evict"})
    wait_for(
        lambda: "GPUPolicyRefused" in event_reasons(world, "lab", name), timeout=60, what="refused"
    )
    # the policy's status is written at the end of the reconcile, after the Event
    wait_for(lambda: "Refused" in _decisions(world, "lab"), timeout=30, what="recorded")
    still: Any = world.core.read_namespaced_pod(name, "lab")
    assert (still.status.phase, still.metadata.deletion_timestamp) == ("Running", None)
    write_node_scenario(world, {})


def _node_marks(world: NodeWorld) -> tuple[str | None, list[str]]:
    """Our condition's status on the Node, and the effects of our taints."""
    node: Any = world.core.read_node(NAME)
    ours = [c for c in node.status.conditions or [] if c.type == names.NODE_CONDITION_ORPHANED]
    taints = [t.effect for t in node.spec.taints or [] if t.key == names.NODE_CONDITION_ORPHANED]
    return (ours[0].status if ours else None), taints


def _node_events(world: NodeWorld) -> list[str]:
    listed = world.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.kind=Node,involvedObject.name={NAME}"
    )
    return [e.reason for e in listed.items]


def test_orphaned_memory_taints_the_node_until_it_is_freed(
    installed: NodeWorld, tmp_path: Path
) -> None:
    """A process of no pod (this test's own, a host process) holds 2 GiB: under an enforced
    Taint rule the node gets the condition and the NoSchedule taint, written by the real
    operator with its real token, which admission refuses any other change to the Node; the
    memory freed, both go. The kubelet's own conditions and taints are never touched."""
    world = installed
    gpu = node_report(world)["spec"]["gpus"][0]["uuid"]
    rule = {"finding": "OrphanedGPUMemory", "after": "2s", "minMemoryMiB": 1024}
    create_policy(
        world.api, "orphans", {"nodeRules": [{**rule, "action": "Taint", "mode": "Enforce"}]}
    )
    custom = client.CustomObjectsApi(world.api)
    try:
        before: Any = world.core.read_node(NAME)
        kubelet_conditions = {c.type for c in before.status.conditions}
        write_node_scenario(
            world, {gpu: [{"pid": os.getpid(), "usedMemoryMiB": 2048, "smUtil": 0}]}
        )
        wait_for(
            lambda: node_report(world)["status"]["orphaned"]["memoryMiB"] == 2048,
            what="the orphaned memory in the report's status",
        )
        wait_for(lambda: _node_marks(world) == ("True", ["NoSchedule"]), timeout=60, what="taint")
        wait_for(lambda: "GPUPolicyActed" in _node_events(world), what="the Event on the Node")
        wait_for(lambda: "Done" in _decisions(world, "orphans"), what="the decision recorded")
        after: Any = world.core.read_node(NAME)
        assert kubelet_conditions <= {c.type for c in after.status.conditions}

        _, pid = component(world, "operator")
        config = token_config(world.cluster, "op", token_of(pid), tmp_path / "op.kubeconfig")
        operator = client.CoreV1Api(api_client(config)[0])
        refused: dict[str, dict[str, Any]] = {
            "a label": {"metadata": {"labels": {"pwned": "yes"}}},
            "unschedulable": {"spec": {"unschedulable": True}},
            "a NoExecute taint": {
                "spec": {"taints": [{"key": names.NODE_CONDITION_ORPHANED, "effect": "NoExecute"}]}
            },
        }
        for what, patch in refused.items():
            with pytest.raises(ApiException) as caught:
                operator.patch_node(NAME, patch)
            assert caught.value.status in (403, 422), what
            assert "gpuusage operator may" in str(caught.value.body), what
        ready = {"type": "Ready", "status": "False", "reason": "Pwned"}
        with pytest.raises(ApiException) as caught:
            operator.patch_node_status(NAME, {"status": {"conditions": [ready]}})
        assert "may change no Node condition" in str(caught.value.body)
        with pytest.raises(ApiException):
            operator.delete_node(NAME)

        write_node_scenario(world, {})
        wait_for(lambda: _node_marks(world) == ("False", []), timeout=60, what="marks cleared")
        wait_for(lambda: "GPUPolicyCleared" in _node_events(world), what="the Event on the Node")
        assert world.core.read_node(NAME).spec.unschedulable in (None, False)
    finally:
        write_node_scenario(world, {})
        custom.delete_cluster_custom_object(
            names.GROUP, names.VERSION, names.POLICY_PLURAL, "orphans"
        )


def _given(world: NodeWorld, pod: Any) -> tuple[str, int]:
    """The device the kubelet gave the pod and its container's real pid on the host."""
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    socket = world.node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}[pod.metadata.name]
    (device,) = given.containers[0].devices[0].device_ids
    return str(device), host_pid(world, cid)


def _unused_pid() -> int:
    """A pid no process has (the agent can read no /proc files for it: unresolved)."""
    return next(p for p in range(4_000_000, 4_100_000) if not Path(f"/proc/{p}").exists())


def test_a_dry_run_an_exempt_pod_and_an_uncertain_one_are_never_acted_upon(
    installed: NodeWorld,
) -> None:
    """Three idle Deployment pods: under a DryRun ScaleToZero the first is recorded and left
    running; the second, exempt by its pod template's annotation, is never announced; the
    third, under an enforced rule, is announced, then its device turns blind (its process
    replaced by one the agent cannot resolve) before the deadline: its condition turns
    Unknown and, past the deadline, its Deployment still has its replica."""
    world = installed
    ns = "quiet"
    _namespace(world, ns)
    apps = client.AppsV1Api(world.api)
    for name in ("dry", "optout", "unsure"):
        deployment: Any = sleeper_deployment(name, ns, 1)
        if name == "optout":
            template = deployment["spec"]["template"]["metadata"]
            template["annotations"] = {names.ANNOTATION_EXEMPT: "true"}
        apps.create_namespaced_deployment(ns, deployment)
    pods: dict[str, Any] = {}
    for name in ("dry", "optout", "unsure"):

        def running(app: str = name) -> Any:
            return running_pod(world, ns, app)

        pods[name] = wait_for(running, timeout=90, what=f"{name} running")
    given = {name: _given(world, pod) for name, pod in pods.items()}
    idle = {
        device: [{"pid": pid, "usedMemoryMiB": 8192, "smUtil": 0}] for device, pid in given.values()
    }
    write_node_scenario(world, idle)
    for name, pod in pods.items():

        def idle_now(pod_name: str = pod.metadata.name) -> bool:
            return _reason(world, ns, pod_name) == "HoldingIdleGPU"

        wait_for(idle_now, timeout=60, what=f"{name} idle")
    custom = client.CustomObjectsApi(world.api)
    both = {"key": "app", "operator": "In", "values": ["dry", "optout"]}
    bodies = {
        "quiet-dry": ({"matchExpressions": [both]}, {"after": "1s", "mode": "DryRun"}),
        "quiet-unsure": ({"matchLabels": {"app": "unsure"}}, {"after": "40s", "mode": "Enforce"}),
    }
    for policy, (pods_selected, rule) in bodies.items():
        spec = {
            "namespaceSelector": in_namespace(ns),
            "podSelector": pods_selected,
            "rules": [{"finding": "HoldingIdleGPU", "action": "ScaleToZero", **rule}],
        }
        create_policy(world.api, policy, spec)
    try:
        dry, optout, unsure = (pods[n].metadata.name for n in ("dry", "optout", "unsure"))
        wait_for(lambda: "DryRun" in _decisions(world, "quiet-dry"), timeout=60, what="dry run")
        wait_for_event(world, ns, dry, "GPUPolicyDryRun")
        announced = wait_for(
            lambda: _pod_annotation(world, ns, unsure), timeout=60, what="the announcement"
        )
        due = datetime.fromisoformat(json.loads(announced)["due"].replace("Z", "+00:00"))
        # Before the deadline the device turns blind: the pod's use is no longer known.
        device, _ = given["unsure"]
        write_node_scenario(
            world,
            {**idle, device: [{"pid": _unused_pid(), "usedMemoryMiB": 8192, "smUtil": 0}]},
        )
        wait_for(
            lambda: (gpu_condition(world, ns, unsure) or {}).get("status") == "Unknown",
            timeout=60,
            what="the pod's use Unknown",
        )
        assert datetime.now(UTC) < due, "the test needs the deadline still ahead"

        def past_deadline_untouched() -> bool:
            for name in ("dry", "unsure"):
                found: Any = apps.read_namespaced_deployment(name, ns)
                assert found.spec.replicas == 1, f"{name} was scaled"
            return datetime.now(UTC) > due + timedelta(seconds=15)

        wait_for(past_deadline_untouched, timeout=90, what="the deadline long past")
        assert "GPUPolicyActed" not in event_reasons(world, ns, unsure)
        assert _pod_annotation(world, ns, unsure) is not None, "held, not cancelled"
        assert _pod_annotation(world, ns, optout) is None
        assert not [e for e in event_reasons(world, ns, optout) if e.startswith("GPUPolicy")]
        still: Any = world.core.read_namespaced_pod(dry, ns)
        assert (still.status.phase, still.metadata.deletion_timestamp) == ("Running", None)
    finally:
        for policy in bodies:
            custom.delete_cluster_custom_object(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, policy
            )
        write_node_scenario(world, {})


def _pod_annotation(world: NodeWorld, namespace: str, pod: str) -> str | None:
    found: Any = world.core.read_namespaced_pod(pod, namespace)
    return (found.metadata.annotations or {}).get(names.ANNOTATION_POLICY_ACTION)
