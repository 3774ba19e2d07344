"""Policies on the real control plane: announced first (the pod's annotation and a Warning
Event with the deadline), a dry run recorded once and nothing done, a Notify carried out, an
exempt pod left alone, an announcement cancelled when its finding clears, and the decisions in
the policy's status."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_operator.nodemarks import NodeMarker
from gpuusage_operator.policynode import NodeMarks
from tests.conftest import GPU0, GPU1, Kubectl, WorldFactory, token_kubeconfig, wait_for
from tests.fakenvml import gpu_uuid
from tests.worldview import events, pod, pod_annotations, scrape

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
NS, OPERATOR_SA = "gpuusage-system", "gpuusage-operator"


def _scenario(world: dict[str, Any], notebook_sm: int) -> None:
    pids = world["pids"]
    world["scenario"](
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [
                    {"pid": pids["train"], "usedMemoryMiB": 30720, "smUtil": 70},
                    {"pid": pids["sneaky"], "usedMemoryMiB": 2048, "smUtil": 20},
                ],
            },
            {
                "index": 1,
                "uuid": GPU1,
                "memoryTotalMiB": 81920,
                "processes": [
                    {"pid": pids["notebook"], "usedMemoryMiB": 71680, "smUtil": notebook_sm}
                ],
            },
            {
                "index": 2,
                "uuid": gpu_uuid(2),
                "memoryTotalMiB": 81920,
                "processes": [{"pid": pids["lab"], "usedMemoryMiB": 40960, "smUtil": 0}],
            },
        ]
    )


@pytest.fixture
def policy(api: client.ApiClient) -> Iterator[dict[str, Any]]:
    """A policy for one namespace, deleted afterwards (other tests' operators would apply it)."""
    created: dict[str, Any] = {}
    yield created
    if created:
        client.CustomObjectsApi(api).delete_cluster_custom_object(
            names.GROUP, names.VERSION, names.POLICY_PLURAL, created["metadata"]["name"]
        )


def _announcement(world: dict[str, Any], name: str) -> dict[str, Any] | None:
    text = pod_annotations(world, name).get(names.ANNOTATION_POLICY_ACTION)
    return json.loads(text) if text else None


def _status(api: client.ApiClient, name: str) -> dict[str, Any]:
    body: Any = client.CustomObjectsApi(api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, name
    )
    return dict(body.get("status") or {})


def test_a_dry_run_announces_records_once_and_does_nothing(
    make_world: WorldFactory, api: client.ApiClient, policy: dict[str, Any]
) -> None:
    exempt = {"annotations": {names.ANNOTATION_EXEMPT: "true"}}
    world = make_world(
        {"train": 1, "notebook": 1, "lab": 1, "sneaky": 0},
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
        operator_extras={"policy_notice": 2.0},
        pod_extras={"lab": exempt},
    )
    _scenario(world, notebook_sm=0)
    name = f"reclaim-{world['ns']}"
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.POLICY_KIND,
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world["ns"]}},
            "rules": [
                {"finding": "HoldingIdleGPU", "after": "1s", "action": "ScaleToZero"},
                {
                    "finding": "UsingUnrequestedGPU",
                    "after": "1s",
                    "action": "Notify",
                    "mode": "Enforce",
                },
            ],
        },
    }
    created: Any = client.CustomObjectsApi(api).create_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, body
    )
    policy.update(created)
    announced = wait_for(lambda: _announcement(world, "notebook"), what="the announcement")
    assert (announced["policy"], announced["finding"], announced["action"]) == (
        name,
        "HoldingIdleGPU",
        "ScaleToZero",
    )
    assert announced["mode"] == "DryRun"
    wait_for(lambda: "GPUPolicyPending" in events(world, "notebook"), what="the warning")
    wait_for(lambda: "GPUPolicyDryRun" in events(world, "notebook"), timeout=60, what="dry run")
    wait_for(lambda: "GPUPolicyNotice" in events(world, "sneaky"), timeout=60, what="notice")

    def outcomes() -> list[tuple[str, str]]:
        listed = _status(api, name).get("decisions") or []
        return sorted((d["target"]["name"], d["outcome"]) for d in listed)

    wait_for(
        lambda: (
            outcomes()
            == [
                ("notebook", "DryRun"),
                ("notebook", "Pending"),
                ("sneaky", "Done"),
                ("sneaky", "Pending"),
            ]
        ),
        what="the decisions in the policy's status",
    )
    status = _status(api, name)
    assert (status["mode"], status["actionsTaken"]) == ("Mixed", 1)
    counted = scrape(world["metrics_port"])
    for action, outcome in (("ScaleToZero", "DryRun"), ("Notify", "Done")):
        series = (
            f'gpuusage_operator_policy_decisions_total{{action="{action}",outcome="{outcome}",'
            f'policy="{name}"}} 1.0'
        )
        assert series in counted, counted
    assert status["rules"] == "HoldingIdleGPU>ScaleToZero,UsingUnrequestedGPU>Notify"
    # Nothing was done to the pod, and the dry run is recorded once.
    counts = world["reconciler"].counts
    seen = counts.reconciles
    wait_for(lambda: counts.reconciles >= seen + 3, what="more reconciles")
    assert events(world, "notebook").count("GPUPolicyDryRun") == 1
    meta: Any = pod(world, "notebook").metadata
    assert meta.deletion_timestamp is None
    # The exempt pod, idle too, is left alone; the computing trainer is never announced.
    assert _announcement(world, "lab") is None
    assert _announcement(world, "train") is None
    assert not [e for e in events(world, "lab") if e.startswith("GPUPolicy")]

    _scenario(world, notebook_sm=60)  # the notebook computes again: the finding clears
    wait_for(lambda: _announcement(world, "notebook") is None, what="the announcement gone")
    wait_for(lambda: "GPUPolicyCancelled" in events(world, "notebook"), what="cancelled")


def test_enforced_actions_stop_at_the_policys_rate_limit(
    make_world: WorldFactory, api: client.ApiClient, policy: dict[str, Any]
) -> None:
    """Two ownerless pods hold GPUs idle under an enforced DeletePod with one action per hour:
    one is deleted, the other waits (RateLimited, a Warning Event, its announcement due an
    hour after the first action), and the status keeps the action's time for the limit."""
    world = make_world(
        {"train": 1, "notebook": 1, "lab": 1, "sneaky": 0},
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
        operator_extras={"policy_notice": 1.0, "policy_actions": True},
    )
    _scenario(world, notebook_sm=0)
    name = f"limit-{world['ns']}"
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.POLICY_KIND,
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world["ns"]}},
            "maxActionsPerHour": 1,
            "rules": [
                {"finding": "HoldingIdleGPU", "action": "DeletePod", "mode": "Enforce"},
            ],
        },
    }
    created: Any = client.CustomObjectsApi(api).create_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, body
    )
    policy.update(created)

    def outcome(pod_name: str) -> set[str]:
        listed = _status(api, name).get("decisions") or []
        return {d["outcome"] for d in listed if d["target"]["name"] == pod_name}

    wait_for(
        lambda: {"Done", "RateLimited"} <= outcome("notebook") | outcome("lab"),
        timeout=60,
        what="one pod deleted, the other rate-limited",
    )
    deleted = "notebook" if "Done" in outcome("notebook") else "lab"
    waiting = "lab" if deleted == "notebook" else "notebook"
    assert "Done" not in outcome(waiting)
    gone: Any = pod(world, deleted).metadata
    kept: Any = pod(world, waiting).metadata
    assert gone.deletion_timestamp is not None
    assert kept.deletion_timestamp is None
    assert "GPUPolicyRateLimited" in events(world, waiting)
    status = _status(api, name)
    assert status["actionsTaken"] == 1
    assert len(status["actedAt"]) == 1
    announced = _announcement(world, waiting)
    assert announced is not None
    acted = datetime.fromisoformat(status["actedAt"][0].replace("Z", "+00:00"))
    due = datetime.fromisoformat(announced["due"].replace("Z", "+00:00"))
    assert due - acted == timedelta(hours=1)


def _node_marks(api: client.ApiClient, node: str) -> tuple[str | None, list[str]]:
    found: Any = client.CoreV1Api(api).read_node(node)
    key = names.NODE_CONDITION_ORPHANED
    ours = [c.status for c in found.status.conditions or [] if c.type == key]
    return (ours[0] if ours else None), [t.effect for t in found.spec.taints or [] if t.key == key]


def test_orphaned_memory_is_recorded_in_a_dry_run_then_marks_the_node_when_enforced(
    make_world: WorldFactory, api: client.ApiClient, policy: dict[str, Any]
) -> None:
    """Xorg (a host process) holds 2 GiB: the report's status says so; a DryRun node rule
    records what it would do and leaves the Node alone; made Enforce, the Node gets the
    condition and the taint (the kubelet's own taints kept); the memory freed, both go."""
    world = make_world({"train": 1}, operator_extras={"policy_actions": True})
    core = client.CoreV1Api(api)
    other = {"key": "example.com/maintenance", "value": "x", "effect": "NoSchedule"}
    core.patch_node(world["node"], {"spec": {"taints": [other]}})
    held = [{"pid": 777, "usedMemoryMiB": 2048, "smUtil": 0}]
    world["scenario"]([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": held}])
    name = f"orphans-{world['ns']}"
    rule = {"finding": "OrphanedGPUMemory", "after": "1s", "minMemoryMiB": 1024, "action": "Taint"}
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.POLICY_KIND,
        "metadata": {"name": name},
        "spec": {"nodeRules": [rule]},
    }
    custom = client.CustomObjectsApi(api)
    created: Any = custom.create_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, body
    )
    policy.update(created)

    def outcomes() -> list[str]:
        listed = _status(api, name).get("decisions") or []
        return [d["outcome"] for d in listed if d["target"]["name"] == world["node"]]

    wait_for(lambda: "DryRun" in outcomes(), timeout=60, what="the dry run recorded")
    report: Any = custom.get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, world["node"]
    )
    assert report["status"]["orphaned"]["memoryMiB"] == 2048
    assert _node_marks(api, world["node"]) == (None, [])
    custom.patch_cluster_custom_object(
        names.GROUP,
        names.VERSION,
        names.POLICY_PLURAL,
        name,
        {"spec": {"nodeRules": [{**rule, "mode": "Enforce"}]}},
    )
    wait_for(
        lambda: _node_marks(api, world["node"]) == ("True", ["NoSchedule"]),
        timeout=60,
        what="the condition and the taint",
    )
    found: Any = core.read_node(world["node"])
    assert {other["key"], names.NODE_CONDITION_ORPHANED} <= {t.key for t in found.spec.taints}
    wait_for(lambda: "Done" in outcomes(), what="the decision")
    world["scenario"]([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []}])
    wait_for(
        lambda: _node_marks(api, world["node"]) == ("False", []),
        timeout=60,
        what="the marks taken off",
    )
    found = core.read_node(world["node"])
    kept = {t.key for t in found.spec.taints}
    assert other["key"] in kept
    assert names.NODE_CONDITION_ORPHANED not in kept
    assert "Cleared" in outcomes()


def test_admission_lets_the_operator_change_nothing_on_a_node_but_its_marks(
    cluster: LocalCluster, api: client.ApiClient, kubectl: Kubectl, tmp_path: Path
) -> None:
    """The policy-actions part's rights and admission policy, under a token of the operator's
    ServiceAccount: its condition and taint come and go (every other taint and condition
    kept); any other change to the Node is refused with the policy's message."""
    core = client.CoreV1Api(api)
    ensure_namespace(core, NS)
    try:
        core.create_namespaced_service_account(
            NS, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=OPERATOR_SA))
        )
    except ApiException as exc:
        if exc.status != 409:
            raise
    parts = [str(REPO / "manifests/policy-actions" / f) for f in ("rbac.yaml", "admission.yaml")]
    kubectl.run("apply", *(a for p in parts for a in ("-f", p)))
    node = f"marks-{uuid.uuid4().hex[:6]}"
    other = {"key": "example.com/maintenance", "value": "x", "effect": "NoSchedule"}
    core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(name=node), spec=client.V1NodeSpec(taints=[other])
        )
    )
    config = token_kubeconfig(cluster, core, NS, OPERATOR_SA, None, path=tmp_path / "op")
    operator_api, _ = api_client(config)
    operator = client.CoreV1Api(operator_api)
    try:

        def refused(patch: dict[str, Any], status: bool = False) -> str:
            call = operator.patch_node_status if status else operator.patch_node
            try:
                call(node, patch)
            except ApiException as exc:
                return str(exc.body)
            return ""

        # the admission policy takes a moment to be in force after it is created (each try a
        # new label value: a patch that changes nothing is no change to refuse)
        wait_for(
            lambda: (
                "may change nothing on a Node"
                in refused({"metadata": {"labels": {"probe": uuid.uuid4().hex}}})
            ),
            what="the admission policy in force",
        )
        core.patch_node(node, {"metadata": {"labels": {"probe": None}}})
        marker = NodeMarker(operator_api)
        now = datetime.now(UTC)
        assert marker.write(node, NodeMarks(True, True), "held", now).outcome == "Done"
        assert marker.read(node) == NodeMarks(True, True)
        found: Any = core.read_node(node)  # (the node lifecycle controller taints it too)
        assert {other["key"], names.NODE_CONDITION_ORPHANED} <= {t.key for t in found.spec.taints}
        key = names.NODE_CONDITION_ORPHANED
        assert "may change no Node taint" in refused(
            {"spec": {"taints": [other, {"key": key, "effect": "NoExecute"}]}}
        )
        assert "may change no Node taint" in refused({"spec": {"taints": [other]}})
        assert "may change nothing on a Node" in refused({"spec": {"unschedulable": True}})
        ready = {"type": "Ready", "status": "False", "reason": "Pwned", "message": "x"}
        assert "may change no Node condition" in refused(
            {"status": {"conditions": [ready]}}, status=True
        )
        assert "may change nothing on a Node" in refused(
            {"status": {"capacity": {"nvidia.com/gpu": "100"}}}, status=True
        )
        with pytest.raises(ApiException):
            operator.delete_node(node)
        # Jobs: suspending is allowed, nothing else (a suspended Job's template is mutable).
        ensure_namespace(core, "jobs-" + node)
        job = client.V1Job(
            metadata=client.V1ObjectMeta(name="epoch"),
            spec=client.V1JobSpec(
                template=client.V1PodTemplateSpec(
                    spec=client.V1PodSpec(
                        restart_policy="Never",
                        containers=[client.V1Container(name="c", image="busybox")],
                    )
                )
            ),
        )
        client.BatchV1Api(api).create_namespaced_job("jobs-" + node, job)
        batch = client.BatchV1Api(operator_api)

        def job_refused(patch: dict[str, Any]) -> str:
            try:
                batch.patch_namespaced_job("epoch", "jobs-" + node, patch)
            except ApiException as exc:
                return str(exc.body)
            return ""

        elsewhere = {"nodeSelector": {"kubernetes.io/hostname": "theirs"}}  # mutable now
        assert "may only suspend a Job" in job_refused({"spec": {"parallelism": 5}})
        assert job_refused({"spec": {"suspend": True}}) == ""
        assert "may change nothing on a Job" in job_refused(
            {"spec": {"template": {"spec": elsewhere}}}
        )
        assert "may only suspend" in job_refused({"spec": {"suspend": False}})
        assert "may change nothing on a Job" in job_refused({"metadata": {"labels": {"a": "b"}}})
        assert marker.write(node, NodeMarks(), "freed", now).outcome == "Done"
        assert marker.read(node) == NodeMarks()
        found = core.read_node(node)
        kept = {t.key for t in found.spec.taints}
        assert other["key"] in kept
        assert names.NODE_CONDITION_ORPHANED not in kept
    finally:
        operator_api.close()  # type: ignore[no-untyped-call]
        kubectl.run("delete", *(a for p in parts for a in ("-f", p)))
        core.delete_node(node)


def test_kubectl_get_shows_a_policys_mode_and_rules_before_it_decides_anything(
    make_world: WorldFactory, api: client.ApiClient, kubectl: Kubectl, policy: dict[str, Any]
) -> None:
    world = make_world({"train": 1})
    world["scenario"](
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [{"pid": world["pids"]["train"], "usedMemoryMiB": 1024, "smUtil": 90}],
            }
        ]
    )
    name = f"quiet-{world['ns']}"
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.POLICY_KIND,
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world["ns"]}},
            "rules": [
                {"finding": "HoldingIdleGPU", "action": "ScaleToZero", "mode": "Enforce"},
                {"finding": "UsingUnallocatedGPU", "action": "Evict", "mode": "Enforce"},
            ],
        },
    }
    created: Any = client.CustomObjectsApi(api).create_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, body
    )
    policy.update(created)
    wait_for(lambda: _status(api, name).get("observedGeneration") == 1, what="the status")
    lines = kubectl.run("get", "gpuusagepolicy", name).splitlines()
    assert lines[0].split() == ["NAME", "MODE", "RULES", "ACTIONS", "AGE"]
    assert lines[1].split()[:4] == [
        name,
        "Enforce",
        "HoldingIdleGPU>ScaleToZero,UsingUnallocatedGPU>Evict",
        "0",
    ]
    assert not _status(api, name).get("decisions")
