"""The findings as OpenReports on the real apiserver, with the CRDs of the OpenReports API from
its Go module: under the operator's shipped rights the reports appear, name the policy that
covers a finding, cost no write while nothing changes, change and go with the findings; the
writer keeps its bound, repairs hand edits, leaves others' reports alone, and where the API is
not served writes nothing and says so once."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
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
from gpuusage_dev.localcluster.tools import OPENREPORTS_CRDS, crds
from gpuusage_dev.simulation import Background, ensure_namespace
from gpuusage_operator.controller.reconcile import Counts
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.main import Operator
from gpuusage_operator.openreports.results import MAX_RESULTS, namespace_results
from gpuusage_operator.openreports.writer import Listing, OpenReportsWriter
from gpuusage_operator.settings import OperatorSettings
from tests.builders import fixed
from tests.conftest import Kubectl, WorldFactory, token_kubeconfig, wait_for
from tests.worldview import create_policy, in_namespace

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
GROUP = (names.OPENREPORTS_GROUP, names.OPENREPORTS_VERSION)
PLURALS = (names.OPENREPORTS_REPORTS, names.OPENREPORTS_CLUSTER_REPORTS)


def _install(kubectl: Kubectl) -> None:
    kubectl.run(
        "apply", "--server-side", *(a for p in crds(OPENREPORTS_CRDS) for a in ("-f", str(p)))
    )
    for plural in PLURALS:
        kubectl.run(
            "wait", "--for=condition=Established", "--timeout=60s", f"crd/{plural}.openreports.io"
        )


def _remove(kubectl: Kubectl) -> None:
    """The CRDs and every report with them: other tests' operators find the API not served."""
    for plural in PLURALS:
        kubectl.run("delete", "--ignore-not-found", "--wait=true", f"crd/{plural}.openreports.io")


@pytest.fixture
def openreports(kubectl: Kubectl) -> Iterator[None]:
    _install(kubectl)
    yield
    _remove(kubectl)


def _report(api: client.ApiClient, namespace: str) -> dict[str, Any]:
    body: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
        *GROUP, namespace, names.OPENREPORTS_REPORTS, names.OPENREPORT_NAME
    )
    return dict(body)


def _cluster_report(api: client.ApiClient) -> dict[str, Any]:
    body: Any = client.CustomObjectsApi(api).get_cluster_custom_object(
        *GROUP, names.OPENREPORTS_CLUSTER_REPORTS, names.OPENREPORT_CLUSTER_NAME
    )
    return dict(body)


def _absent(api: client.ApiClient, namespace: str) -> bool:
    try:
        _report(api, namespace)
    except ApiException as exc:
        return bool(exc.status == 404)
    return False


def _about(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [r for r in report.get("results") or [] if r["resources"][0]["name"] == name]


def _others(api: client.ApiClient, node: str) -> set[str]:
    """The cluster's other reports (of earlier tests' nodes)."""
    listed: Any = client.CustomObjectsApi(api).list_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL
    )
    return {item["metadata"]["name"] for item in listed["items"]} - {node}


def _stale(api: client.ApiClient) -> set[str]:
    """The nodes the nodes' report says are stale."""
    results = _cluster_report(api).get("results") or []
    return {r["resources"][0]["name"] for r in results if r["rule"] == "NodeReportStale"}


@pytest.fixture
def operator_token(cluster: LocalCluster, api: client.ApiClient, tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig with a token of a ServiceAccount bound to a copy of the shipped operator
    ClusterRole (its rules as manifests/base/operator/rbac.yaml has them, under a name of its
    own, so that the installs other tests make are left alone)."""
    docs = list(yaml.safe_load_all((REPO / "manifests/base/operator/rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    name = f"openreports-{uuid.uuid4().hex[:6]}"
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    ensure_namespace(core, name)
    core.create_namespaced_service_account(
        name, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="operator"))
    )
    made: Any = {**role, "metadata": {"name": name}}  # the client sends a dict as it is
    rbac.create_cluster_role(made)
    binding: Any = {
        "metadata": {"name": name},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": name,
        },
        "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": name}],
    }
    rbac.create_cluster_role_binding(binding)
    try:
        yield token_kubeconfig(cluster, core, name, "operator", None, path=tmp_path / "op.kc")
    finally:
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)
        core.delete_namespace(name)


def _allowed(api: client.ApiClient, verb: str, group: str, resource: str, name: str = "") -> bool:
    attributes = {"verb": verb, "group": group, "resource": resource, "name": name}
    asked: Any = {"spec": {"resourceAttributes": attributes}}
    review: Any = client.AuthorizationV1Api(api).create_self_subject_access_review(asked)
    return bool(review.status.allowed)


def test_findings_come_and_go_as_reports_at_no_cost_while_steady(
    openreports: None,
    make_world: WorldFactory,
    api: client.ApiClient,
    operator_token: Path,
    cluster: LocalCluster,
) -> None:
    # The notebook uses a GPU it did not request; Xorg (no pod) holds memory on GPU0.
    world = make_world({"train": 1, "notebook": 0}, operator=False)
    settings = OperatorSettings(
        kubeconfig=operator_token, stale_after=4.0, resync=0.5, standalone=True
    )
    built = Operator(settings)
    ready = threading.Event()
    serving = Background(lambda stop: built.run(stop, ready))
    try:
        assert ready.wait(60), "the operator did not start under its token"
        operator_api, _ = api_client(operator_token)
        with operator_api:
            group = names.OPENREPORTS_GROUP
            for plural in PLURALS:
                for verb in ("list", "create"):
                    assert _allowed(operator_api, verb, group, plural)
                for verb in ("update", "delete"):  # its own reports only
                    for ours in (names.OPENREPORT_NAME, names.OPENREPORT_CLUSTER_NAME):
                        assert _allowed(operator_api, verb, group, plural, ours)
                    assert not _allowed(operator_api, verb, group, plural, "kyverno-pods")
                    assert not _allowed(operator_api, verb, group, plural)
                for verb in ("patch", "deletecollection", "watch"):
                    assert not _allowed(operator_api, verb, group, plural)
            assert not _allowed(operator_api, "create", "wgpolicyk8s.io", "policyreports")

        report = wait_for(lambda: _report(api, world.ns), what="the namespace's Report")
        assert report["metadata"]["labels"] == {names.MANAGED_BY_LABEL: names.MANAGED_BY}
        assert report["source"] == "gpuusage"
        [result] = report["results"]
        assert (result["rule"], result["policy"], result["result"], result["severity"]) == (
            "UsingUnrequestedGPU",
            "UsingUnrequestedGPU",
            "fail",
            "high",
        )
        assert result["resources"] == [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": world.ns,
                "name": "notebook",
                "uid": world.uids["notebook"],
            }
        ]
        assert result["properties"]["node"] == world.node
        assert report["summary"] == {"pass": 0, "fail": 1, "warn": 0, "error": 0, "skip": 0}
        nodes = wait_for(
            lambda: _about(_cluster_report(api), world.node), what="the node's orphaned memory"
        )
        assert [(r["rule"], r["result"]) for r in nodes] == [("OrphanedGPUMemory", "warn")]

        # A policy covering the finding: its name, action and deadline are in the result.
        policy = f"misuse-{world.ns}"
        rule = {"finding": "UsingUnrequestedGPU", "after": "1h", "action": "Notify"}
        create_policy(api, policy, {"namespaceSelector": in_namespace(world.ns), "rules": [rule]})
        try:
            covered = wait_for(
                lambda: (r := _report(api, world.ns)["results"][0])["policy"] == policy and r,
                what="the covering policy in the result",
            )
            assert covered["properties"]["action"] == "Notify"
            assert covered["properties"]["mode"] == "DryRun"
            assert "dueAt" in covered["properties"]

            # Steady: the operator keeps judging and publishing, and writes no report. (The
            # earlier tests' nodes, their agents gone, are stale first: the nodes' report
            # says so of each before the steady spell is measured.)
            wait_for(
                lambda: _others(api, world.node) <= _stale(api),
                what="every other node's report judged stale",
            )
            counts: Counts = built.reconciler.counts
            assert built.openreports is not None
            writes, passes = counts.openreport_writes, built.openreports.passes
            reconciles = counts.reconciles
            versions = (
                _report(api, world.ns)["metadata"]["resourceVersion"],
                _cluster_report(api)["metadata"]["resourceVersion"],
            )
            wait_for(
                lambda: built.openreports is not None and built.openreports.passes >= passes + 12,
                what="a dozen publishing passes",
            )
            assert counts.reconciles > reconciles
            assert counts.openreport_writes == writes
            assert (
                _report(api, world.ns)["metadata"]["resourceVersion"],
                _cluster_report(api)["metadata"]["resourceVersion"],
            ) == versions
        finally:
            client.CustomObjectsApi(api).delete_cluster_custom_object(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, policy
            )

        # The finding goes: so does the namespace's Report.
        world.write(notebook=False)
        wait_for(lambda: _absent(api, world.ns), what="the Report to go with its last finding")

        # The node's agent stops: its report turns stale, and that is all that is said of it.
        world.agent.halt()
        stale = wait_for(
            lambda: [
                r
                for r in _about(_cluster_report(api), world.node)
                if r["rule"] == "NodeReportStale"
            ],
            what="the node's stale report",
        )
        assert [r["result"] for r in _about(_cluster_report(api), world.node)] == ["error"]
        assert stale[0]["resources"] == [{"apiVersion": "v1", "kind": "Node", "name": world.node}]
    finally:
        serving.halt()


def _pods(namespace: str, count: int) -> list[PodSnapshot]:
    condition = {
        "type": names.POD_CONDITION_GPU_IN_USE,
        "status": "True",
        "reason": "UsingUnrequestedGPU",
        "message": "1 process uses GPU-0",
    }
    return [
        PodSnapshot(
            namespace=namespace,
            name=f"pod-{i:04d}",
            uid=f"{uuid.uuid4()}",
            node="gpu-x",
            condition=tuple(sorted(condition.items())),
        )
        for i in range(count)
    ]


def test_the_writer_keeps_its_bound_repairs_hand_edits_and_leaves_others_reports(
    openreports: None, api: client.ApiClient
) -> None:
    custom = client.CustomObjectsApi(api)
    namespace = f"or-{uuid.uuid4().hex[:6]}"
    ensure_namespace(client.CoreV1Api(api), namespace)
    foreign = {
        "apiVersion": "openreports.io/v1alpha1",
        "kind": "Report",
        "metadata": {"name": "kyverno-pods"},
        "source": "kyverno",
        "results": [{"policy": "require-labels", "result": "fail"}],
    }
    custom.create_namespaced_custom_object(*GROUP, namespace, names.OPENREPORTS_REPORTS, foreign)
    counts = Counts()
    writer = OpenReportsWriter(client.CustomObjectsApi(api), counts, fixed(Listing()), relist=0)
    now = datetime.now(UTC)
    findings = namespace_results(_pods(namespace, MAX_RESULTS + 25))

    writer.publish(findings, [], now=now)
    report = _report(api, namespace)
    assert len(report["results"]) == MAX_RESULTS + 1
    assert report["results"][-1]["rule"] == "ResultsOmitted"
    assert report["results"][-1]["properties"] == {"omitted": "25"}
    assert report["summary"]["fail"] == MAX_RESULTS
    written = counts.openreport_writes

    writer.publish(findings, [], now=now)  # nothing changed: nothing written
    assert counts.openreport_writes == written

    # A person empties it, then deletes it: each time the next pass puts it back.
    custom.patch_namespaced_custom_object(
        *GROUP, namespace, names.OPENREPORTS_REPORTS, names.OPENREPORT_NAME, {"results": []}
    )
    writer.publish(findings, [], now=now)
    assert len(_report(api, namespace)["results"]) == MAX_RESULTS + 1
    custom.delete_namespaced_custom_object(
        *GROUP, namespace, names.OPENREPORTS_REPORTS, names.OPENREPORT_NAME
    )
    writer.publish(findings, [], now=now)
    assert len(_report(api, namespace)["results"]) == MAX_RESULTS + 1
    assert counts.openreport_errors == 0

    # A person takes our label off: the list no longer shows it, the name is taken; the
    # report is found by its name and written whole again, label and all.
    custom.patch_namespaced_custom_object(
        *GROUP,
        namespace,
        names.OPENREPORTS_REPORTS,
        names.OPENREPORT_NAME,
        {"metadata": {"labels": {names.MANAGED_BY_LABEL: None}}},
    )
    for _ in range(2):
        writer.publish(findings, [], now=now)
    relabelled = _report(api, namespace)
    assert relabelled["metadata"]["labels"] == {names.MANAGED_BY_LABEL: names.MANAGED_BY}
    assert len(relabelled["results"]) == MAX_RESULTS + 1

    # The findings go: our Report goes, Kyverno's stays as it was.
    writer.publish({}, [], now=now)
    assert _absent(api, namespace)
    kept: Any = custom.get_namespaced_custom_object(
        *GROUP, namespace, names.OPENREPORTS_REPORTS, "kyverno-pods"
    )
    assert kept["results"] == foreign["results"]


def test_where_the_api_is_not_served_nothing_is_written_and_that_is_said_once(
    kubectl: Kubectl, api: client.ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    _remove(kubectl)
    namespace = f"or-{uuid.uuid4().hex[:6]}"
    ensure_namespace(client.CoreV1Api(api), namespace)
    counts = Counts()
    writer = OpenReportsWriter(
        client.CustomObjectsApi(api), counts, fixed(Listing()), unserved_retry=0
    )
    findings = namespace_results(_pods(namespace, 2))
    caplog.set_level(logging.INFO, logger="gpuusage_operator.openreports.writer")
    try:
        for _ in range(3):
            writer.publish(findings, [], now=datetime.now(UTC))
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1, said
        assert "openreports.io/v1alpha1 is not served" in said[0]
        assert "--no-openreports" in said[0]
        assert str(writer.unserved) == "not served"
        assert counts.openreport_writes == 0

        _install(kubectl)

        def published() -> bool:
            writer.publish(findings, [], now=datetime.now(UTC))
            return not _absent(api, namespace)

        wait_for(published, what="the Report once the API is served")
        assert writer.unserved is None
        assert any("is served" in r.getMessage() for r in caplog.records[1:])
    finally:
        _remove(kubectl)


def test_with_pod_marks_off_the_reports_carry_the_findings_no_pod_shows(
    openreports: None, make_world: WorldFactory, api: client.ApiClient
) -> None:
    """Observe first: the notebook uses a GPU it did not request; nothing is written on it,
    and its namespace's Report says so all the same, as with marks."""
    world = make_world({"train": 1, "notebook": 0}, operator_extras={"pod_marks": False})
    world.write(notebook=True)

    def results() -> list[dict[str, Any]]:
        return [] if _absent(api, world.ns) else _about(_report(api, world.ns), "notebook")

    [result] = wait_for(results, what="the finding in the namespace's Report")
    assert (result["rule"], result["result"]) == ("UsingUnrequestedGPU", "fail")
    assert result["resources"][0]["uid"] == world.uids["notebook"]
    assert result["properties"]["node"] == world.node
    for name in ("notebook", "train"):  # (an earlier test's pods on the node lose theirs)
        found: Any = world.core.read_namespaced_pod(name, world.ns)
        assert not [k for k in found.metadata.annotations or {} if k.startswith("gpuusage.io/")]
        assert not [c for c in found.status.conditions or [] if c.type.startswith("gpuusage.io/")]
