"""Observe first and scope, on the real apiserver: with --no-pod-marks the operator writes on no
pod and the report's status carries everything; a start with marks off takes off the marks an
earlier one wrote, once, and says how many; --namespace-selector marks only the namespaces that
match and the status says which pods are outside; the observe install's rights hold no pod
write, and the operator's Events may be counted in a series."""

from __future__ import annotations

import logging
import re
import threading
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import Background
from gpuusage_operator.main import Operator
from gpuusage_operator.settings import OperatorSettings
from tests.conftest import CHART, Helm, Kubectl, WorldFactory, wait_for
from tests.worldview import condition, conditions, events, pod, pod_annotations, report

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
UNMARK = ["operator.podMarks=false", "operator.unmarkPods=true"]


def marked(world: Any, name: str) -> bool:
    found: Any = pod(world, name)
    ours = {k for k in (found.metadata.annotations or {}) if k.startswith("gpuusage.io/")}
    return bool(ours) or any(c.type == names.POD_CONDITION_GPU_IN_USE for c in conditions(found))


def listed(world: Any, name: str) -> list[dict[str, Any]]:
    status = report(world).get("status") or {}
    return [p for p in status.get("pods") or [] if p["name"] == name]


def test_with_pod_marks_off_no_pod_is_written_and_the_status_says_it_all(
    make_world: WorldFactory,
) -> None:
    world = make_world({"train": 1, "notebook": 1}, operator_extras={"pod_marks": False})
    world.write(notebook=True)
    found = wait_for(lambda: listed(world, "train"), what="the status lists the pod")
    assert found[0]["usedMemoryMiB"] == 30720
    wait_for(lambda: listed(world, "notebook"), what="both pods listed")
    # (pod writes may take off marks a stopping operator of an earlier test left: none is put)
    memory = world.reconciler.terms.current.marks
    assert (memory.applied, memory.written) == ({}, {}), "no mark written"
    assert world.reconciler.counts.events == 0, "no Event about a pod"
    assert not marked(world, "train")
    assert not marked(world, "notebook")
    assert events(world, "train") == []


def start_operator(cluster: LocalCluster, **settings: Any) -> tuple[Operator, Background]:
    ready = threading.Event()
    built = Operator(
        OperatorSettings(
            kubeconfig=cluster.kubeconfig, standalone=True, resync=0.5, stale_after=4.0, **settings
        )
    )
    serving = Background(lambda stop: built.run(stop, ready))
    assert ready.wait(60), "operator did not become ready"
    return built, serving


def test_a_start_with_marks_off_takes_off_the_marks_of_the_last_once_and_says_how_many(
    make_world: WorldFactory, cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    world = make_world({"train": 1, "notebook": 1})
    world.write(notebook=True)
    wait_for(lambda: marked(world, "train") and marked(world, "notebook"), what="marked")
    wait_for(lambda: condition(pod(world, "notebook")), what="the condition written")
    world.stop_operator()
    caplog.set_level(logging.INFO, logger="gpuusage_operator.controller.housekeeping")
    built, serving = start_operator(cluster, pod_marks=False)
    try:
        wait_for(
            lambda: not marked(world, "train") and not marked(world, "notebook"),
            timeout=30,
            what="the marks taken off",
        )
        # (the cluster's other pods with marks, of earlier tests, lose theirs too: how many
        # still carry them depends on those, so only the count taken off is held here)
        said = wait_for(
            lambda: [
                int(found[1])
                for r in caplog.records
                if (found := re.match(r"took gpuusage's marks off (\d+) pods", r.getMessage()))
            ],
            timeout=30,
            what="said how many",
        )
        assert max(said) >= 2
        assert max(said) <= built.reconciler.counts.marks_removed
        writes = built.reconciler.counts.pod_writes
        world.write(notebook=False)  # the notebook's process ends: nothing to write on it now
        wait_for(lambda: not listed(world, "notebook"), what="the status follows")
        assert built.reconciler.counts.pod_writes == writes, "once: no write after"
    finally:
        serving.halt()


def test_the_namespace_selector_marks_only_the_namespaces_that_match(
    make_world: WorldFactory,
) -> None:
    world = make_world({"train": 1}, operator_extras={"namespace_selector": "gpuusage-test=in"})
    core: client.CoreV1Api = world.core
    world.write(notebook=False)
    found = wait_for(
        lambda: [p for p in listed(world, "train") if p.get("outOfScope")],
        what="listed, outside the selector",
    )
    assert found[0]["usedMemoryMiB"] == 30720, "counted all the same"
    assert not marked(world, "train")
    core.patch_namespace(world.ns, {"metadata": {"labels": {"gpuusage-test": "in"}}})
    wait_for(
        lambda: pod_annotations(world, "train").get(names.ANNOTATION_GPU_MEMORY_MIB) == "30720",
        timeout=15,
        what="marked once its namespace is selected",
    )
    wait_for(lambda: not listed(world, "train")[0].get("outOfScope"), what="in scope")
    removed = world.reconciler.counts.marks_removed  # (of earlier tests' pods, outside)
    core.patch_namespace(world.ns, {"metadata": {"labels": {"gpuusage-test": "out"}}})
    wait_for(lambda: not marked(world, "train"), timeout=15, what="its marks taken off")
    assert world.reconciler.counts.marks_removed > removed


def test_marks_turned_on_later_do_not_date_an_ended_use_from_the_pods_start(
    make_world: WorldFactory, cluster: LocalCluster
) -> None:
    """Observe first, then marks on: a pod the observing operator saw in use, whose process
    ended while no operator ran, carries none of gpuusage's marks. Its idleness dates from
    the restart (the report's last status saw it in use), not from the pod's start two hours
    ago: no RequestedGPUsIdle at once, nor a policy due before its `after`."""
    world = make_world({"train": 1, "notebook": 1}, operator_extras={"pod_marks": False})
    started = datetime.now(UTC) - timedelta(hours=2)
    world.core.patch_namespaced_pod_status(
        "notebook", world.ns, {"status": {"startTime": format_time(started)}}
    )
    world.write(notebook=True)
    wait_for(lambda: listed(world, "notebook"), what="the observing operator sees it in use")
    world.stop_operator()
    world.write(notebook=False)  # its process ends while no operator runs
    wait_for(
        lambda: (
            not any(
                p["pid"] == world.pids["notebook"]
                for g in report(world)["spec"]["gpus"]
                for p in g.get("processes") or []
            )
        ),
        what="the agent reports it ended",
    )
    restarted = datetime.now(UTC).replace(microsecond=0)
    _built, serving = start_operator(cluster)  # marks on, --idle-after 30 min
    try:
        found = wait_for(
            lambda: (c := condition(pod(world, "notebook"))).status == "False" and c,
            timeout=30,
            what="its use written as ended",
        )
        assert found.reason != "RequestedGPUsIdle", found
        assert found.last_transition_time >= restarted, "ended from the restart, not its start"
        idle = (report(world).get("status") or {}).get("idlePods") or []
        assert [p["name"] for p in idle] == [], "not idle since it started"
        assert "RequestedGPUsIdle" not in events(world, "notebook")
        assert marked(world, "train"), "marks on"
    finally:
        serving.halt()


def rules_of(rendered: str, kind: str, name: str) -> list[dict[str, Any]]:
    for doc in yaml.safe_load_all(rendered):
        if doc and doc.get("kind") == kind and doc["metadata"]["name"] == name:
            return list(doc["rules"])
    raise AssertionError(f"no {kind} {name}")


def may(api: client.ApiClient, user: str, verb: str, resource: str, sub: str = "") -> bool:
    review: Any = client.AuthorizationV1Api(api).create_subject_access_review(
        cast(
            Any,
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user,
                    "resourceAttributes": {
                        "group": "events.k8s.io" if resource == "events" else "",
                        "resource": resource,
                        "subresource": sub,
                        "verb": verb,
                        "namespace": "default",
                    },
                },
            },
        )
    )
    return bool(review.status.allowed)


@pytest.mark.slow
def test_the_observe_install_may_not_write_pods_and_every_install_may_count_event_series(
    kubectl: Kubectl, api: client.ApiClient, helm_binary: Path, tmp_path: Path
) -> None:
    """The kustomize overlay and the chart with operator.podMarks=false, applied as ClusterRoles
    of their own: pods read, never written; Events created and patched (a series). The chart
    with operator.unmarkPods=true keeps the pod writes that taking old marks off needs."""
    observe = kubectl.run("kustomize", str(REPO / "manifests/overlays/observe"))
    cases = {
        "kustomize-observe": (rules_of(observe, "ClusterRole", "gpuusage-operator"), False),
    }
    helm = Helm(helm_binary, tmp_path)
    for sets, writes in ((["operator.podMarks=false"], False), (UNMARK, True)):
        rendered = helm.run("template", "gpuusage", str(CHART), *(f"--set={s}" for s in sets))
        rules = rules_of(rendered.stdout, "ClusterRole", "gpuusage-operator")
        cases[f"chart-{len(sets)}"] = (rules, writes)
    default = kubectl.run("kustomize", str(REPO / "manifests/base"))
    cases["kustomize-default"] = (rules_of(default, "ClusterRole", "gpuusage-operator"), True)
    rbac = client.RbacAuthorizationV1Api(api)
    for n, (name, (rules, writes)) in enumerate(cases.items()):
        role, user = f"gpuusage-test-observe-{n}", f"observe-user-{n}"
        rbac.create_cluster_role(cast(Any, {"metadata": {"name": role}, "rules": rules}))
        ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role}
        subject = {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
        binding = {"metadata": {"name": role}, "roleRef": ref, "subjects": [subject]}
        rbac.create_cluster_role_binding(cast(Any, binding))
        try:
            wait_for(partial(may, api, user, "list", "pods"), what=f"{name}: pods read")
            assert may(api, user, "patch", "pods") is writes, name
            assert may(api, user, "patch", "pods", "status") is writes, name
            assert may(api, user, "create", "events"), name
            assert may(api, user, "patch", "events"), f"{name}: an Event series is counted"
        finally:
            rbac.delete_cluster_role_binding(role)
            rbac.delete_cluster_role(role)
