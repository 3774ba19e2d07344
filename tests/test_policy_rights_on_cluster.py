"""The policy-actions part on the real apiserver, under a token of the operator's
ServiceAccount: its rights do what each action needs, and its admission policies let the
operator make exactly those changes (a Node's OrphanedGPUMemory marks, a Job's, a JobSet's
suspension, a Notebook's stop annotation, a Kueue Workload's deactivation) and no other. A
workload a GitOps tool or an autoscaler would put back is left alone, and an install without
the rights to tell acts on none."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import create_running_pod, ensure_namespace
from gpuusage_operator.policies.act import NOTEBOOK_STOPPED, Actor, Result
from gpuusage_operator.policies.nodemarks import NodeMarker
from gpuusage_operator.policies.noderule import NodeMarks
from tests.conftest import Kubectl, token_kubeconfig, wait_for
from tests.workloads import (
    KEDA_OWNED,
    autoscaler,
    controller_ref,
    deployment_of,
    made,
    replica_set_of,
    replicas,
    scaled_object_ref,
)

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
NS, OPERATOR_SA = "gpuusage-system", "gpuusage-operator"
PARTS = [REPO / "manifests/policy-actions" / f for f in ("rbac.yaml", "admission.yaml")]


@pytest.fixture
def operator_api(
    cluster: LocalCluster, api: client.ApiClient, kubectl: Kubectl, tmp_path: Path
) -> Iterator[client.ApiClient]:
    """An API client with a token of the operator's ServiceAccount, the policy-actions part's
    rights and admission policies applied (and removed afterwards: other tests prove the base
    install's rights); once the admission policies are in force."""
    core = client.CoreV1Api(api)
    ensure_namespace(core, NS)
    try:
        core.create_namespaced_service_account(
            NS, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=OPERATOR_SA))
        )
    except ApiException as exc:
        if exc.status != 409:
            raise
    files = [a for p in PARTS for a in ("-f", str(p))]
    kubectl.run("apply", *files)
    config = token_kubeconfig(cluster, core, NS, OPERATOR_SA, None, path=tmp_path / "op")
    operator, _ = api_client(config)
    probe = f"probe-{uuid.uuid4().hex[:6]}"
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=probe)))
    batch = client.BatchV1Api(api)
    container = client.V1Container(name="c", image="busybox")
    probe_job = client.V1Job(
        metadata=client.V1ObjectMeta(name=probe),
        spec=client.V1JobSpec(
            suspend=True,
            template=client.V1PodTemplateSpec(
                spec=client.V1PodSpec(restart_policy="Never", containers=[container])
            ),
        ),
    )
    batch.create_namespaced_job(NS, probe_job)
    try:

        def refused(patch: Callable[[], object], message: str) -> bool:
            try:
                patch()
            except ApiException as exc:
                return message in str(exc.body)
            return False

        def in_force() -> bool:
            """Each policy is loaded by the apiserver on its own: every one tested here is
            probed, each try with a new value (a patch that changes nothing is nothing to
            refuse)."""
            value = uuid.uuid4().hex
            as_operator, jobs = client.CoreV1Api(operator), client.BatchV1Api(operator)
            return refused(
                lambda: as_operator.patch_node(probe, {"metadata": {"labels": {"p": value}}}),
                "may change nothing on a Node",
            ) and refused(
                lambda: jobs.patch_namespaced_job(
                    probe, NS, {"spec": {"parallelism": int(value[:4], 16) + 2}}
                ),
                "may change nothing on a Job",  # suspended: only spec.suspend may change
            )

        wait_for(in_force, what="the admission policies in force")
        yield operator
    finally:
        operator.close()  # type: ignore[no-untyped-call]
        core.delete_node(probe)
        batch.delete_namespaced_job(probe, NS, propagation_policy="Background")
        kubectl.run("delete", *files)


def test_admission_lets_the_operator_change_nothing_on_a_node_but_its_marks(
    api: client.ApiClient, operator_api: client.ApiClient
) -> None:
    """Its condition and taint come and go (every other taint and condition kept); any other
    change to the Node is refused with the policy's message; on a Job only suspending."""
    core = client.CoreV1Api(api)
    node = f"marks-{uuid.uuid4().hex[:6]}"
    other = {"key": "example.com/maintenance", "value": "x", "effect": "NoSchedule"}
    core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(name=node), spec=client.V1NodeSpec(taints=[other])
        )
    )
    operator = client.CoreV1Api(operator_api)
    try:

        def refused(patch: dict[str, Any], status: bool = False) -> str:
            call = operator.patch_node_status if status else operator.patch_node
            try:
                call(node, patch)
            except ApiException as exc:
                return str(exc.body)
            return ""

        marker = NodeMarker(operator_api)
        now = datetime.now(UTC)
        assert marker.write(node, NodeMarks(True, True), "held", now).outcome == "Done"
        assert marker.read(node) == NodeMarks(True, True)
        listed = marker.marked()  # the right to list the Nodes, for a new term's sweep
        assert isinstance(listed, set)
        assert node in listed
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
        core.delete_node(node)


def _crd(group: str, kind: str, plural: str, version: str) -> dict[str, Any]:
    """A stand-in CRD of another project (its real schema does not matter here)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


OTHERS = {
    "notebook": ("kubeflow.org", "Notebook", "notebooks", "v1"),
    "jobset": ("jobset.x-k8s.io", "JobSet", "jobsets", "v1alpha2"),
    "workload": ("kueue.x-k8s.io", "Workload", "workloads", "v1beta1"),
}


def _job_suspended(api: client.ApiClient, ns: str, name: str) -> bool:
    found: Any = client.BatchV1Api(api).read_namespaced_job(name, ns)
    return bool(found.spec.suspend)


def _owned(core: client.CoreV1Api, ns: str, pod: str, owner: dict[str, Any], kind: str) -> str:
    """Make the pod (running) owned by `owner` as its controller; its UID."""
    meta = owner["metadata"]
    api_version = owner.get("apiVersion") or ("apps/v1" if kind == "StatefulSet" else "batch/v1")
    ref = {"apiVersion": api_version, "kind": kind, "name": meta["name"], "uid": meta["uid"]}
    labels = (owner.get("spec") or {}).get("selector", {}).get("matchLabels") or {}
    uid, _ = create_running_pod(core, ns, pod, "gpu-elsewhere", "main", gpus=1)
    core.patch_namespaced_pod(
        pod, ns, {"metadata": {"labels": labels, "ownerReferences": [{**ref, "controller": True}]}}
    )
    return uid


def test_notebooks_jobsets_and_kueue_workloads_are_stopped_the_way_their_controllers_read(
    api: client.ApiClient, operator_api: client.ApiClient, kubectl: Kubectl
) -> None:
    """A Notebook's pod (through its StatefulSet): ScaleToZero annotates the Notebook, the
    StatefulSet is left to its controller. A JobSet's pod (through its Job): Suspend
    suspends the JobSet. A Kueue-managed Job's pod: Suspend deactivates its Workload. Each
    under the operator's token; any other change to those objects is refused."""
    kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump_all([_crd(*o) for o in OTHERS.values()]))
    for group, _, plural, _ in OTHERS.values():
        kubectl.run("wait", "--for=condition=Established", f"crd/{plural}.{group}")
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    ns = f"kf-{uuid.uuid4().hex[:6]}"
    ensure_namespace(core, ns)

    def create(which: str, name: str, spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
        group, kind, plural, version = OTHERS[which]
        body = {
            "apiVersion": f"{group}/{version}",
            "kind": kind,
            "metadata": {"name": name, **meta},
            "spec": spec,
        }
        created: Any = custom.create_namespaced_custom_object(group, version, ns, plural, body)
        return dict(created)

    template = {"spec": {"containers": [{"name": "main", "image": "jupyter"}]}}
    notebook = create("notebook", "lab", {"template": template})
    owner = controller_ref(notebook)
    labels = {"statefulset": "lab"}
    statefulset: Any = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "lab", "ownerReferences": [owner]},
        "spec": {
            "replicas": 1,
            "serviceName": "lab",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, **template},
        },
    }
    apps: Any = client.AppsV1Api(api)
    sts = made(apps.create_namespaced_stateful_set(ns, statefulset, _preload_content=False))
    lab_uid = _owned(core, ns, "lab-0", sts, "StatefulSet")

    def job(name: str, owners: list[dict[str, Any]], job_labels: dict[str, str]) -> dict[str, Any]:
        body = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "ownerReferences": owners, "labels": job_labels},
            "spec": {
                "managedBy": "example.com/elsewhere",  # the Job controller leaves it alone
                "template": {
                    "spec": {"restartPolicy": "Never", **template["spec"]},
                },
            },
        }
        batch: Any = client.BatchV1Api(api)
        return made(batch.create_namespaced_job(ns, body, _preload_content=False))

    jobset = create("jobset", "train", {"replicatedJobs": [{"name": "w", "replicas": 1}]})
    js_owner = controller_ref(jobset)
    worker = job("train-w-0", [js_owner], {})
    worker_uid = _owned(core, ns, "train-w-0-abc", worker, "Job")
    queued = job("queued", [], {"kueue.x-k8s.io/queue-name": "gpus"})
    queued_uid = _owned(core, ns, "queued-abc", queued, "Job")
    create(
        "workload",
        "job-queued-1a2b3",
        {"active": True, "queueName": "gpus", "podSets": [{"name": "main", "count": 1}]},
        labels={"kueue.x-k8s.io/job-uid": queued["metadata"]["uid"]},
    )

    actor = Actor(operator_api)
    result = actor.act(ns, "lab-0", lab_uid, "ScaleToZero")
    assert (result.outcome, result.detail) == (
        "Done",
        f"stopped Notebook {ns}/lab ({NOTEBOOK_STOPPED})",
    )
    found: Any = custom.get_namespaced_custom_object("kubeflow.org", "v1", ns, "notebooks", "lab")
    assert NOTEBOOK_STOPPED in found["metadata"]["annotations"]
    kept: Any = client.AppsV1Api(api).read_namespaced_stateful_set("lab", ns)
    assert kept.spec.replicas == 1, "the Notebook's controller scales its StatefulSet"

    assert actor.act(ns, "train-w-0-abc", worker_uid, "Suspend").outcome == "Done"
    found = custom.get_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", ns, "jobsets", "train"
    )
    assert found["spec"]["suspend"] is True
    assert not _job_suspended(api, ns, "train-w-0")

    assert actor.act(ns, "queued-abc", queued_uid, "Suspend").outcome == "Done"
    found = custom.get_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta1", ns, "workloads", "job-queued-1a2b3"
    )
    assert found["spec"]["active"] is False
    assert not _job_suspended(api, ns, "queued")

    # A pod a controller owns may not be deleted by the operator; one no controller owns may.
    pods = client.CoreV1Api(operator_api)
    with pytest.raises(ApiException) as refused:
        pods.delete_namespaced_pod("lab-0", ns)
    assert "may delete only pods that no controller owns" in str(refused.value.body)
    create_running_pod(core, ns, "stray", "gpu-elsewhere", "main", gpus=1)
    pods.delete_namespaced_pod("stray", ns)

    # Anything else on those objects is refused under the operator's token.
    theirs = client.CustomObjectsApi(operator_api)
    attempts: dict[tuple[str, str, str, str], dict[str, Any]] = {
        ("kubeflow.org", "v1", "notebooks", "lab"): {
            "spec": {"template": {"spec": {"serviceAccountName": "admin"}}}
        },
        ("jobset.x-k8s.io", "v1alpha2", "jobsets", "train"): {
            "spec": {"replicatedJobs": [{"name": "w", "replicas": 9}]}
        },
        ("kueue.x-k8s.io", "v1beta1", "workloads", "job-queued-1a2b3"): {"spec": {"active": True}},
    }
    for (group, version, plural, name), patch in attempts.items():
        with pytest.raises(ApiException) as caught:
            theirs.patch_namespaced_custom_object(group, version, ns, plural, name, patch)
        assert caught.value.status == 403, plural
        assert "the gpuusage operator may" in str(caught.value.body), plural


def _managed(ns: str, workload: str, who: str) -> str:
    """The detail of a ManagedElsewhere outcome about `workload` ("Kind name")."""
    kind, name = workload.split(" ")
    return f"{kind} {ns}/{name} is managed elsewhere: {who}"


ARGO_ID = "argocd.argoproj.io/tracking-id"
FLUX_APPLIED = {
    "kustomize.toolkit.fluxcd.io/name": "apps",
    "kustomize.toolkit.fluxcd.io/namespace": "flux-system",
}


def test_what_a_neighbour_would_undo_is_left_alone_and_the_rest_is_acted_upon(
    api: client.ApiClient, operator_api: client.ApiClient, kubectl: Kubectl
) -> None:
    """Under the operator's token. Deployments that Argo CD tracks (its annotation; its label),
    that Flux applies or that KEDA's autoscaler scales, and a ReplicaSet an Argo Rollout
    controls keep their replica: ManagedElsewhere, saying who would undo it. One Helm
    installed (its instance label names its release), one whose plain autoscaler stops at zero
    and one nobody else keeps are scaled to zero. A Job Flux applies and a JobSet Argo CD
    tracks are not suspended; a plain Job is."""
    core = client.CoreV1Api(api)
    ns = f"nb-{uuid.uuid4().hex[:6]}"
    ensure_namespace(core, ns)
    deployments: dict[str, tuple[dict[str, str], dict[str, str]]] = {
        "argo-annotated": ({}, {ARGO_ID: f"shop:apps/Deployment:{ns}/argo-annotated"}),
        "argo-labelled": ({"app.kubernetes.io/instance": "shop"}, {}),
        "flux": (FLUX_APPLIED, {}),
        "keda": ({}, {}),
        "helm": ({"app.kubernetes.io/instance": "serve"}, {"meta.helm.sh/release-name": "serve"}),
        "paused": ({}, {}),
        "plain": ({}, {}),
    }
    uids: dict[str, str] = {}
    for name, (labels, notes) in deployments.items():
        uids[name], _ = create_running_pod(core, ns, f"{name}-0", "gpu-elsewhere", "main", gpus=1)
        deployment_of(api, ns, f"{name}-0", name, labels=labels, annotations=notes)
    autoscaler(api, ns, "keda-hpa-keda", "keda", labels=KEDA_OWNED, owner=scaled_object_ref("keda"))
    autoscaler(api, ns, "paused", "paused")
    uids["canary"], _ = create_running_pod(core, ns, "canary-0", "gpu-elsewhere", "main", gpus=1)
    rollout = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Rollout",
        "metadata": {"name": "canary", "uid": str(uuid.uuid4())},
    }
    replica_set_of(api, ns, "canary-0", "canary-6c9f", owner=rollout)

    actor = Actor(operator_api)
    acted = {name: actor.act(ns, f"{name}-0", uid, "ScaleToZero") for name, uid in uids.items()}
    undo = "and would undo it"
    assert {name: (r.outcome, r.detail) for name, r in acted.items()} == {
        "argo-annotated": (
            "ManagedElsewhere",
            _managed(
                ns, "Deployment argo-annotated", f"Argo CD tracks it (annotation {ARGO_ID}) {undo}"
            ),
        ),
        "argo-labelled": (
            "ManagedElsewhere",
            _managed(
                ns,
                "Deployment argo-labelled",
                f"Argo CD tracks it (label app.kubernetes.io/instance=shop) {undo}",
            ),
        ),
        "flux": (
            "ManagedElsewhere",
            _managed(
                ns, "Deployment flux", f"Flux's Kustomization flux-system/apps applies it {undo}"
            ),
        ),
        "keda": (
            "ManagedElsewhere",
            _managed(
                ns,
                "Deployment keda",
                "KEDA's ScaledObject keda scales it (HorizontalPodAutoscaler keda-hpa-keda) and "
                "would scale it up again",
            ),
        ),
        "canary": (
            "ManagedElsewhere",
            f"Rollout {ns}/canary controls ReplicaSet canary-6c9f and would scale it back",
        ),
        "helm": ("Done", f"scaled Deployment {ns}/helm to zero"),
        "paused": (
            "Done",
            f"scaled Deployment {ns}/paused to zero (HorizontalPodAutoscaler paused stops "
            "scaling it at zero)",
        ),
        "plain": ("Done", f"scaled Deployment {ns}/plain to zero"),
    }
    for name in deployments:
        left = 0 if acted[name].outcome == "Done" else 1
        assert replicas(api, ns, "Deployment", name) == left, name
    assert replicas(api, ns, "ReplicaSet", "canary-6c9f") == 1

    # Suspend: the Job and the JobSet a GitOps tool keeps are left running.
    kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(_crd(*OTHERS["jobset"])))
    kubectl.run("wait", "--for=condition=Established", "crd/jobsets.jobset.x-k8s.io")
    custom = client.CustomObjectsApi(api)
    group, kind, plural, version = OTHERS["jobset"]
    jobset_body = {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": {"name": "sweep", "annotations": {ARGO_ID: f"hp:{group}/JobSet:{ns}/sweep"}},
        "spec": {"replicatedJobs": [{"name": "w", "replicas": 1}]},
    }
    jobset: Any = custom.create_namespaced_custom_object(group, version, ns, plural, jobset_body)
    batch: Any = client.BatchV1Api(api)

    def job(name: str, labels: dict[str, str], owners: list[dict[str, Any]]) -> str:
        body = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": labels, "ownerReferences": owners},
            "spec": {
                "managedBy": "example.com/elsewhere",  # the Job controller leaves it alone
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "main", "image": "registry.example/app:1"}],
                    }
                },
            },
        }
        job_made = made(batch.create_namespaced_job(ns, body, _preload_content=False))
        return _owned(core, ns, f"{name}-abc", job_made, "Job")

    fluxed = job("fluxed", FLUX_APPLIED, [])
    swept = job("sweep-w-0", {}, [controller_ref(dict(jobset))])
    alone = job("alone", {}, [])
    fluxed_result = actor.act(ns, "fluxed-abc", fluxed, "Suspend")
    assert (fluxed_result.outcome, fluxed_result.detail) == (
        "ManagedElsewhere",
        _managed(ns, "Job fluxed", f"Flux's Kustomization flux-system/apps applies it {undo}"),
    )
    swept_result = actor.act(ns, "sweep-w-0-abc", swept, "Suspend")
    assert (swept_result.outcome, swept_result.detail) == (
        "ManagedElsewhere",
        _managed(ns, "JobSet sweep", f"Argo CD tracks it (annotation {ARGO_ID}) {undo}"),
    )
    assert actor.act(ns, "alone-abc", alone, "Suspend").outcome == "Done"
    assert not _job_suspended(api, ns, "fluxed")
    found: Any = custom.get_namespaced_custom_object(group, version, ns, plural, "sweep")
    assert "suspend" not in found["spec"]
    assert _job_suspended(api, ns, "alone")


def test_an_install_that_may_not_list_autoscalers_scales_nothing(
    cluster: LocalCluster, api: client.ApiClient, kubectl: Kubectl, tmp_path: Path
) -> None:
    """The policy-actions part as it was before the autoscaler check (its ClusterRole without
    the list of horizontalpodautoscalers): the operator cannot tell whether an autoscaler would
    scale a Deployment up again, so it scales nothing and says why (NotPermitted)."""
    core = client.CoreV1Api(api)
    older = f"older-{uuid.uuid4().hex[:6]}"
    ensure_namespace(core, older)
    core.create_namespaced_service_account(
        older, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=OPERATOR_SA))
    )
    role = next(d for d in yaml.safe_load_all(PARTS[0].read_text()) if d["kind"] == "ClusterRole")
    role["metadata"]["name"] = older
    role["rules"] = [r for r in role["rules"] if r["apiGroups"] != ["autoscaling"]]
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": older},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": older},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": older}],
    }
    manifest = yaml.safe_dump_all([role, binding])
    kubectl.run("apply", "-f", "-", stdin=manifest)
    config = token_kubeconfig(cluster, core, older, OPERATOR_SA, None, path=tmp_path / "older")
    operator, _ = api_client(config)
    try:
        uid, _ = create_running_pod(core, older, "web-0", "gpu-elsewhere", "main", gpus=1)
        deployment_of(api, older, "web-0", "web")
        actor = Actor(operator)

        def decided() -> Result | None:
            """What the actor makes of the pod, once the binding is in force (before, it may
            not even read the pod)."""
            found = actor.act(older, "web-0", uid, "ScaleToZero")
            return None if found.detail.startswith("the operator may not ScaleToZero") else found

        result = wait_for(decided, what="the older rights in force")
        assert (result.outcome, result.detail) == (
            "NotPermitted",
            f"the operator may not list HorizontalPodAutoscalers in {older}, so it cannot tell "
            f"whether one would scale Deployment {older}/web up again",
        )
        assert replicas(api, older, "Deployment", "web") == 1
    finally:
        operator.close()  # type: ignore[no-untyped-call]
        kubectl.run("delete", "-f", "-", stdin=manifest)
