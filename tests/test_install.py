"""The install, proven on the real apiserver under the components' own identities.

Both install paths, one after the other: `kubectl apply -k manifests/` into gpuusage-system,
and `helm install` of charts/gpuusage into another namespace. Tokens are minted for the agent's
and the operator's ServiceAccounts by TokenRequest, bound to pods on given nodes (as kubelet's
projected tokens are), and the agent and the operator run with them. Then every promise of the
RBAC and of the admission policy is checked by trying to break it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage.settings import comma_list
from gpuusage_commands.reads import VIEWER_ROLE
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.proctree import pod_cgroup, write_process
from gpuusage_dev.simulation import Background, create_running_pod, ensure_namespace
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.main import run_operator
from gpuusage_operator.settings import OperatorSettings
from tests.conftest import CHILD_ENV, Helm, Kubectl, token_kubeconfig, wait_for
from tests.examples import empty_report
from tests.fakenvml import gpu_uuid
from tests.worldview import renewed_at

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
NS = "gpuusage-system"
HELM_NS, HELM_RELEASE = "gpuusage-helm", "gpuusage-rights"
AGENT_SA, OPERATOR_SA = "gpuusage-agent", "gpuusage-operator"


@dataclass(frozen=True)
class Install:
    cluster: LocalCluster
    namespace: str
    """Where the agent, the operator and the agents' Leases are."""


@pytest.fixture(scope="module")
def kustomized(cluster: LocalCluster) -> LocalCluster:
    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    out = kubectl.run("apply", "-k", str(REPO / "manifests"))
    assert "daemonset.apps/gpuusage-agent" in out
    assert "validatingadmissionpolicybinding.admissionregistration.k8s.io" in out
    return cluster


@pytest.fixture(scope="module", params=["kustomize", "helm"])
def installed(
    request: pytest.FixtureRequest,
    cluster: LocalCluster,
    helm_binary: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Install]:
    if request.param == "kustomize":
        yield Install(request.getfixturevalue("kustomized"), NS)
        return
    helm = Helm(helm_binary, tmp_path_factory.mktemp("helm"), cluster.kubeconfig)
    # The cluster-scoped objects (ClusterRoles, the admission policy) have fixed names, and the
    # kustomize install made them: the release takes them over as when a cluster moves from
    # `kubectl apply` to Helm (README), forcing the fields kubectl applied.
    args = ("-n", HELM_NS, "--create-namespace", "--take-ownership", "--force-conflicts")
    out = helm.run("install", HELM_RELEASE, str(REPO / "charts" / "gpuusage"), *args).stdout
    assert "STATUS: deployed" in out
    try:
        yield Install(cluster, HELM_NS)
    finally:
        helm.run("uninstall", HELM_RELEASE, "-n", HELM_NS, check=False)


def _identity_pod(core: client.CoreV1Api, ns: str, sa: str, node: str) -> client.V1Pod:
    """A pod of the ServiceAccount on the node: what a projected token is bound to."""
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name=f"{sa}-{uuid.uuid4().hex[:5]}"),
        spec=client.V1PodSpec(
            node_name=node,
            service_account_name=sa,
            automount_service_account_token=False,
            containers=[client.V1Container(name="main", image="registry.example/gpuusage:1")],
        ),
    )
    created: client.V1Pod = core.create_namespaced_pod(ns, pod)
    return created


def _denied(call: Callable[[], Any], *fragments: str) -> str:
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status in (403, 422), caught.value
    body = str(caught.value.body)
    for fragment in fragments:
        assert fragment in body, body
    return body


@dataclass(frozen=True)
class InstallWorld:
    """Two nodes of the installed cluster and a pod on the first, with an agent and an operator
    running under their ServiceAccounts' tokens, and API clients under those tokens."""

    admin: client.ApiClient
    core: Any
    """A client.CoreV1Api. Typed Any: its models make every field optional, and the tests read
    them as the apiserver fills them."""
    ns: str
    a: str
    """The agent's node (the pod runs there)."""
    b: str
    """Another node (the operator's pod is bound there)."""
    agent_api: client.ApiClient
    """Under the agent's token, bound to its pod on node a."""
    operator_api: client.ApiClient
    unbound_api: client.ApiClient
    """Under an agent token bound to no pod."""
    cluster: LocalCluster
    tmp: Path
    home: str
    """The install's namespace."""


@pytest.fixture(scope="module")
def world(installed: Install, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstallWorld]:
    cluster, home = installed.cluster, installed.namespace
    tmp = tmp_path_factory.mktemp("install")
    admin, _ = api_client(cluster.kubeconfig)
    core = client.CoreV1Api(admin)
    suffix = uuid.uuid4().hex[:5]
    node_a, node_b = f"gpu-a-{suffix}", f"gpu-b-{suffix}"
    for node in (node_a, node_b):
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
    ns = f"team-{suffix}"
    ensure_namespace(core, ns)
    uid, cid = create_running_pod(core, ns, "train", node_a, "trainer")
    proc = tmp / "proc"
    write_process(proc, 4242, pod_cgroup(uid, cid), comm="python3", start_ticks=4242)
    scenario = tmp / "scenario.yaml"
    gpu = {
        "index": 0,
        "uuid": gpu_uuid(0),
        "memoryTotalMiB": 81920,
        "processes": [{"pid": 4242, "usedMemoryMiB": 20480}],
    }
    scenario.write_text(yaml.safe_dump({"gpus": [gpu]}))
    agent_pod = _identity_pod(core, home, AGENT_SA, node_a)
    operator_pod = _identity_pod(core, home, OPERATOR_SA, node_b)
    agent_kc = token_kubeconfig(
        cluster, core, home, AGENT_SA, agent_pod, path=tmp / "agent.kubeconfig"
    )
    operator_kc = token_kubeconfig(
        cluster, core, home, OPERATOR_SA, operator_pod, path=tmp / "operator.kubeconfig"
    )
    unbound_kc = token_kubeconfig(
        cluster, core, home, AGENT_SA, None, path=tmp / "unbound.kubeconfig"
    )
    agent_settings = AgentSettings(
        node_name=node_a,
        interval=0.5,
        heartbeat=2.0,
        gpu_source=f"fake:{scenario}",
        proc_root=proc,
        kubeconfig=agent_kc,
        metrics_port=0,
        lease_namespace=home,
        lease_duration=10,
        report_refresh=2.0,  # a test rewrites the spec behind the agent's back
    )
    ready = threading.Event()
    operator_settings = OperatorSettings(
        kubeconfig=operator_kc,
        resync=0.5,
        leader_elect_resource_namespace=home,
        lease_namespace=home,
    )
    agent = Background(lambda stop: run_agent(agent_settings, stop))
    operator = Background(lambda stop: run_operator(operator_settings, stop, ready))
    apis = {
        name: api_client(path)[0]
        for name, path in (("agent", agent_kc), ("operator", operator_kc), ("unbound", unbound_kc))
    }
    try:
        assert ready.wait(60), "the operator did not start under its own identity"
        yield InstallWorld(
            admin=admin,
            core=core,
            ns=ns,
            a=node_a,
            b=node_b,
            agent_api=apis["agent"],
            operator_api=apis["operator"],
            unbound_api=apis["unbound"],
            cluster=cluster,
            tmp=tmp,
            home=home,
        )
    finally:
        agent.halt()
        operator.halt()
        for api in apis.values():
            api.close()  # type: ignore[no-untyped-call]
        admin.close()  # type: ignore[no-untyped-call]


def test_agent_and_operator_work_under_their_own_service_accounts(world: InstallWorld) -> None:
    custom = client.CustomObjectsApi(world.admin)

    def report() -> dict[str, Any]:
        body = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, world.a)
        assert isinstance(body, dict)
        return body

    body = wait_for(
        lambda: (r := report()).get("status", {}).get("totals") and r,
        what="the agent's report and the operator's status",
    )
    owner = body["metadata"]["ownerReferences"][0]
    node = world.core.read_node(world.a)
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", world.a, node.metadata.uid)
    assert body["status"]["totals"]["pods"] == 1

    def marked() -> Any:
        pod = world.core.read_namespaced_pod("train", world.ns)
        types = {c.type for c in pod.status.conditions or []}
        ours = names.ANNOTATION_GPUS in (pod.metadata.annotations or {})
        return pod if ours and names.POD_CONDITION_GPU_IN_USE in types else None

    pod = wait_for(marked, what="the operator's annotations and condition on the pod")
    assert pod.metadata.annotations[names.ANNOTATION_GPU_MEMORY_MIB] == "20480"
    condition = next(c for c in pod.status.conditions if c.type == names.POD_CONDITION_GPU_IN_USE)
    assert condition.status == "True"
    events = client.EventsV1Api(world.admin)
    reasons = wait_for(
        lambda: [e.reason for e in events.list_namespaced_event(world.ns).items],
        what="the operator's Event",
    )
    assert reasons == ["GPUUseStarted"]


def test_agent_token_is_held_to_its_own_node_and_to_spec(world: InstallWorld) -> None:
    agent = client.CustomObjectsApi(world.agent_api)
    a, b = world.a, world.b
    group = (names.GROUP, names.VERSION, names.PLURAL)
    _denied(
        lambda: agent.create_cluster_custom_object(*group, empty_report(b)),
        f"may only write the GpuNodeUsage and the Lease named {a}, not {b}",
    )
    _denied(
        lambda: agent.patch_cluster_custom_object_status(*group, a, {"status": {}}),
        "gpunodeusages/status",
    )
    _denied(lambda: agent.delete_cluster_custom_object(*group, a), "cannot delete")
    _denied(
        lambda: agent.patch_cluster_custom_object(
            *group, a, {"metadata": {"labels": {"team": "evil"}}}
        ),
        "labels, annotations",
    )
    _denied(
        lambda: agent.patch_cluster_custom_object(
            *group,
            a,
            {
                "metadata": {
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": b, "uid": "x"}]
                }
            },
        ),
        "only be owned by the agent's own Node",
    )
    core = client.CoreV1Api(world.agent_api)
    patch = {"metadata": {"annotations": {names.ANNOTATION_GPUS: "forged"}}}
    _denied(lambda: core.patch_namespaced_pod("train", world.ns, patch), "cannot patch")
    _denied(lambda: core.list_namespaced_secret(world.home), "cannot list")
    # Its Node, for the driver-upgrade label: get only (RBAC cannot name the node)
    own: Any = core.read_node(a)
    assert own.metadata.name == a
    _denied(core.list_node, 'cannot list resource \\"nodes\\"')
    _denied(
        lambda: core.patch_node(a, {"metadata": {"labels": {"x": "y"}}}),
        'cannot patch resource \\"nodes\\"',
    )
    unbound = client.CustomObjectsApi(world.unbound_api)
    _denied(
        lambda: unbound.patch_cluster_custom_object(*group, a, {"spec": {}}),
        "token bound to a pod on a node",
    )
    # What it may do, it still can: its own spec.
    agent.patch_cluster_custom_object(*group, a, {"spec": {"gpus": []}})


def test_a_compromised_agent_can_mark_only_its_own_nodes_pods(world: InstallWorld) -> None:
    """The whole promise end to end: an agent of node B, under its real pod-bound token, writes
    the report it may write (its own node's) and names in it the pod of node A by container ID
    and pod UID. The operator, under its own token, lists those processes as PodOnOtherNode and
    leaves A's pod exactly as it was."""
    core = world.core
    train = core.read_namespaced_pod("train", world.ns)
    cid = train.status.container_statuses[0].container_id.split("://", 1)[1]

    def in_use() -> bool:  # (an earlier test wiped the report's GPUs for a moment)
        pod = core.read_namespaced_pod("train", world.ns)
        ours = [c for c in pod.status.conditions or [] if c.type == names.POD_CONDITION_GPU_IN_USE]
        return [(c.status, c.reason) for c in ours] == [("True", "ProcessesRunning")]

    group = (names.GROUP, names.VERSION, names.PLURAL)
    admin = client.CustomObjectsApi(world.admin)

    def rewritten() -> bool:
        body = admin.get_cluster_custom_object(*group, world.a)
        assert isinstance(body, dict)
        return bool(body["spec"]["gpus"])

    wait_for(rewritten, what="node A's agent to have rewritten its report")
    wait_for(in_use, what="train in use")
    before = core.read_namespaced_pod("train", world.ns).metadata.annotations
    events = client.EventsV1Api(world.admin)

    def event_reasons() -> list[str]:
        return sorted(str(e.reason) for e in events.list_namespaced_event(world.ns).items)

    seen = event_reasons()
    b = world.b
    kubeconfig = token_kubeconfig(
        world.cluster,
        core,
        world.home,
        AGENT_SA,
        _identity_pod(core, world.home, AGENT_SA, b),
        path=world.tmp / "agent-b.kubeconfig",
    )
    agent_b, _ = api_client(kubeconfig)
    forged = empty_report(b)
    processes = [
        {"pid": 7, "usedMemoryMiB": 999, "containerID": cid},
        {"pid": 8, "usedMemoryMiB": 1, "podUID": train.metadata.uid},
    ]
    forged["spec"]["gpus"] = [
        {"index": 0, "uuid": gpu_uuid(1), "memory": {"totalMiB": 81920}, "processes": processes}
    ]
    try:
        client.CustomObjectsApi(agent_b).create_cluster_custom_object(*group, forged)

        def reasons() -> dict[int, str]:
            body = admin.get_cluster_custom_object(*group, b)
            assert isinstance(body, dict)
            found = (body.get("status") or {}).get("unattributed") or []
            return {u["pid"]: u["reason"] for u in found}

        wait_for(
            lambda: reasons() == {7: "PodOnOtherNode", 8: "PodOnOtherNode"},
            what="the forged processes refused by the operator",
        )
        assert core.read_namespaced_pod("train", world.ns).metadata.annotations == before
        assert in_use()
        assert event_reasons() == seen, "no Event either"
    finally:
        admin.delete_cluster_custom_object(*group, b)
        agent_b.close()  # type: ignore[no-untyped-call]


def test_operator_token_cannot_write_spec_or_delete(world: InstallWorld) -> None:
    operator = client.CustomObjectsApi(world.operator_api)
    group = (names.GROUP, names.VERSION, names.PLURAL)
    _denied(
        lambda: operator.patch_cluster_custom_object(*group, world.a, {"spec": {}}),
        'cannot patch resource \\"gpunodeusages\\"',
    )
    _denied(
        lambda: operator.create_cluster_custom_object(*group, empty_report(world.b)),
        "cannot create",
    )
    core = client.CoreV1Api(world.operator_api)
    _denied(lambda: core.delete_namespaced_pod("train", world.ns), "cannot delete")
    _denied(lambda: core.list_namespaced_secret(world.home), "cannot list")
    _denied(
        lambda: core.create_namespaced_pod(
            world.ns,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name="x"),
                spec=client.V1PodSpec(containers=[client.V1Container(name="x", image="x")]),
            ),
        ),
        "cannot create",
    )


@pytest.mark.parametrize(
    "overlay", ["manifests", "manifests/overlays/host-proc", "manifests/overlays/namespace"]
)
def test_every_manifest_validates_server_side(
    kustomized: LocalCluster, kubectl: Kubectl, api: client.ApiClient, overlay: str
) -> None:
    if overlay.endswith("namespace"):
        try:
            ensure_namespace(client.CoreV1Api(api), "gpu-monitoring")
        except ApiException as exc:
            if exc.status != 409:
                raise
    out = kubectl.run("apply", "-k", str(REPO / overlay), "--dry-run=server")
    assert "daemonset.apps/gpuusage-agent" in out
    assert "deployment.apps/gpuusage-operator" in out


def _agent_pod_spec(kubectl: Kubectl, folder: str) -> dict[str, Any]:
    rendered = yaml.safe_load_all(kubectl.run("kustomize", str(REPO / folder)))
    (agent,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    spec: dict[str, Any] = agent["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize(
    "overlay",
    [
        "manifests",
        "manifests/overlays/host-proc",
        "manifests/overlays/namespace",
        "manifests/overlays/monitoring",
    ],
)
def test_every_install_gives_the_agent_the_kubelets_socket_read_only(
    kubectl: Kubectl, overlay: str
) -> None:
    """The default agent may connect to the kubelet's root-owned socket (as root, with no
    capability); the base alone keeps the non-root agent without it."""
    spec = _agent_pod_spec(kubectl, overlay)
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "pod-resources"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/var/lib/kubelet/pod-resources", True)
    (volume,) = [v for v in spec["volumes"] if v["name"] == "pod-resources"]
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert spec["securityContext"]["runAsUser"] == 0
    container = spec["containers"][0]["securityContext"]
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["allowPrivilegeEscalation"] is False
    assert container["readOnlyRootFilesystem"] is True
    default = AgentSettings(node_name="n").pod_resources_socket
    assert default.parent == Path(mount["mountPath"])
    cdi = [m for m in spec["containers"][0]["volumeMounts"] if m["name"].startswith("cdi-specs")]
    folders = comma_list(AgentSettings(node_name="n").cdi_spec_dirs)
    assert [(m["mountPath"], m["readOnly"]) for m in cdi] == [(f, True) for f in folders]
    assert [v["hostPath"] for v in spec["volumes"] if v["name"].startswith("cdi-specs")] == [
        {"path": f, "type": "DirectoryOrCreate"} for f in folders
    ]
    base = _agent_pod_spec(kubectl, "manifests/base")
    assert all(v["name"] != "pod-resources" for v in base["volumes"])
    assert all(not v["name"].startswith("cdi-specs") for v in base["volumes"])
    assert base["securityContext"]["runAsUser"] == 65532


def _lease(name: str, namespace: str) -> client.V1Lease:
    return client.V1Lease(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        spec=client.V1LeaseSpec(holder_identity="gpuusage-agent/x", lease_duration_seconds=40),
    )


def test_the_agent_renews_its_own_nodes_lease_and_no_other(world: InstallWorld) -> None:
    """Under its real pod-bound token the agent creates and renews the Lease named after its
    node (owned by that Node), and the operator judges the report fresh by it; the same token
    may not write another node's Lease, a Lease in another namespace (the kubelet's own), or
    delete its own."""
    home = world.home
    leases = client.CoordinationV1Api(world.admin)
    lease = wait_for(lambda: leases.read_namespaced_lease(world.a, home), what="the Lease")
    assert lease.spec.holder_identity.startswith("gpuusage-agent/")
    assert lease.spec.lease_duration_seconds == 10
    owner = lease.metadata.owner_references[0]
    node = world.core.read_node(world.a)
    assert (owner.kind, owner.name, owner.uid) == ("Node", world.a, node.metadata.uid)
    first = renewed_at(world.admin, world.a, home)
    assert first is not None
    wait_for(
        lambda: (t := renewed_at(world.admin, world.a, home)) is not None and t > first,
        what="a renewal",
    )
    custom = client.CustomObjectsApi(world.admin)

    def stale_reason() -> str | None:
        body = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, world.a)
        assert isinstance(body, dict)
        conditions = (body.get("status") or {}).get("conditions") or []
        return next((c["reason"] for c in conditions if c["type"] == "Stale"), None)

    wait_for(lambda: stale_reason() == "LeaseRenewed", what="freshness judged by the Lease")

    agent = client.CoordinationV1Api(world.agent_api)
    renewal = {"spec": {"renewTime": "2026-11-24T10:00:00.000000Z"}}
    leases.create_namespaced_lease(home, _lease(world.b, home))  # node b's, as its agent made it
    _denied(
        lambda: agent.patch_namespaced_lease(world.b, home, renewal),
        "may only write the GpuNodeUsage and the Lease named " + world.a,
    )
    other = world.b + "-x"
    _denied(lambda: agent.create_namespaced_lease(home, _lease(other, home)), other)
    _denied(
        lambda: agent.create_namespaced_lease("kube-node-lease", _lease(world.a, "kube-node-lease"))
    )
    _denied(lambda: agent.delete_namespaced_lease(world.a, home))
    _denied(lambda: agent.read_namespaced_lease(world.a, home))
    unbound = client.CoordinationV1Api(world.unbound_api)
    _denied(
        lambda: unbound.patch_namespaced_lease(world.a, home, renewal),
        "token bound to a pod on a node",
    )
    operator = client.CoordinationV1Api(world.operator_api)
    _denied(lambda: operator.patch_namespaced_lease(world.a, home, renewal))


def test_the_operator_holds_its_own_lease_and_cannot_write_the_agents(world: InstallWorld) -> None:
    """Leader election under the operator's real token: it took the Lease gpuusage-operator in
    its namespace; it may neither read nor replace nor delete an agent's Lease by name, nor
    write a Lease in another namespace."""
    home = world.home
    admin: Any = client.CoordinationV1Api(world.admin)  # read as the server fills it
    held: str = wait_for(
        lambda: admin.read_namespaced_lease(names.LEADER_LEASE, home).spec.holder_identity,
        what="the operator to take its Lease",
    )
    assert held.endswith(f"/{os.getpid()}"), held  # the operator runs in this process
    operator: Any = client.CoordinationV1Api(world.operator_api)
    assert operator.read_namespaced_lease(names.LEADER_LEASE, home).spec.holder_identity == held
    agents = wait_for(lambda: admin.read_namespaced_lease(world.a, home), what="an agent's Lease")
    _denied(lambda: operator.read_namespaced_lease(world.a, home))
    _denied(lambda: operator.replace_namespaced_lease(world.a, home, agents))
    _denied(lambda: operator.delete_namespaced_lease(world.a, home))
    _denied(lambda: operator.create_namespaced_lease("default", _lease("x", "default")))


def test_operator_token_may_write_only_its_marks_on_a_pod(world: InstallWorld) -> None:
    """Admission (gpuusage-operator-own-marks) holds the operator's `patch pods` to its own
    annotations and condition: the image, labels, people's annotations (exempt), another
    condition and the phase are refused under its token; its annotation and condition pass.
    The policy's annotation list is names.OPERATOR_ANNOTATIONS."""
    core = client.CoreV1Api(world.operator_api)
    ns = world.ns
    pod = client.CoreV1Api(world.admin).read_namespaced_pod("train", ns)
    assert pod.metadata is not None
    assert pod.spec is not None
    uid = {"uid": pod.metadata.uid}
    image = {"containers": [{"name": pod.spec.containers[0].name, "image": "evil"}]}
    refusals: dict[str, tuple[dict[str, Any], bool]] = {
        "the image": ({"spec": image}, False),
        "a label": ({"metadata": {"labels": {"pwned": "yes"}}}, False),
        "people's annotation": (
            {"metadata": {"annotations": {names.ANNOTATION_EXEMPT: "true"}}},
            False,
        ),
        "another annotation": ({"metadata": {"annotations": {"example.com/x": "1"}}}, False),
        "another condition": (
            {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
            True,
        ),
        "the phase": ({"status": {"phase": "Failed"}}, True),
    }
    for what, (patch, status) in refusals.items():
        call = core.patch_namespaced_pod_status if status else core.patch_namespaced_pod

        def refused(c: Callable[..., Any] = call, p: dict[str, Any] = patch) -> bool:
            return _refused(lambda: c("train", ns, p))

        # the admission policy comes into force shortly after the install
        wait_for(refused, what=f"{what} refused")
    ours = {names.ANNOTATION_USAGE: "{}"}
    core.patch_namespaced_pod("train", ns, {"metadata": {**uid, "annotations": ours}})
    condition = {"type": names.POD_CONDITION_GPU_IN_USE, "status": "Unknown", "reason": "Test"}
    core.patch_namespaced_pod_status("train", ns, {"status": {"conditions": [condition]}})
    gone = {"type": names.POD_CONDITION_GPU_IN_USE, "$patch": "delete"}
    core.patch_namespaced_pod_status("train", ns, {"status": {"conditions": [gone]}})
    core.patch_namespaced_pod(
        "train", ns, {"metadata": {"annotations": {names.ANNOTATION_USAGE: None}}}
    )
    shipped = yaml.safe_load_all(
        (REPO / "manifests/base/admission/operator-own-marks.yaml").read_text()
    )
    (vap,) = [d for d in shipped if d["kind"] == "ValidatingAdmissionPolicy"]
    (ours_var,) = [v for v in vap["spec"]["variables"] if v["name"] == "ours"]
    listed = ours_var["expression"].strip("[] ").replace("'", "").split(",")
    assert [k.strip() for k in listed] == list(names.OPERATOR_ANNOTATIONS)


def _refused(call: Callable[[], Any]) -> bool:
    try:
        call()
    except ApiException as exc:
        return exc.status == 403 and "the gpuusage operator may" in str(exc.body)
    return False


def test_a_person_bound_to_the_viewer_role_sees_every_report_and_writes_nothing(
    world: InstallWorld,
) -> None:
    """The ClusterRole gpuusage-viewer as each install serves it: aggregated to no other role
    (the reports list every tenant's processes); a person bound to it runs `gpuusage top -A`
    (with the pods' pending actions) and `ps -A`, and may write nothing and read no Secret."""
    rbac = client.RbacAuthorizationV1Api(world.admin)
    role: Any = rbac.read_cluster_role(VIEWER_ROLE)
    assert not [k for k in role.metadata.labels or {} if "aggregate-to" in k]
    assert role.aggregation_rule is None
    sa = f"viewer-{uuid.uuid4().hex[:5]}"
    world.core.create_namespaced_service_account(
        world.ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=sa))
    )
    binding = client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=sa),
        role_ref=client.V1RoleRef(
            api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=VIEWER_ROLE
        ),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=sa, namespace=world.ns)],
    )
    rbac.create_cluster_role_binding(binding)
    custom = client.CustomObjectsApi(world.admin)
    group = (names.GROUP, names.VERSION, names.PLURAL)

    def resolved() -> bool:
        body: Any = custom.get_cluster_custom_object(*group, world.a)
        pods = (body.get("status") or {}).get("pods") or []
        return any(p["namespace"] == world.ns and p["name"] == "train" for p in pods)

    try:
        wait_for(resolved, what="the operator's status names the pod")
        kubeconfig = token_kubeconfig(
            world.cluster, world.core, world.ns, sa, None, path=world.tmp / f"{sa}.kubeconfig"
        )

        def gpuusage(*args: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "gpuusage.cli", *args, f"--kubeconfig={kubeconfig}"]
            return subprocess.run(
                command, capture_output=True, text=True, check=False, env=CHILD_ENV
            )

        top = gpuusage("top", "-A")
        assert (top.returncode, top.stderr) == (0, ""), top.stderr
        rows = [line.split()[:3] for line in top.stdout.splitlines()]
        assert [world.ns, "train", world.a] in rows
        ps = gpuusage("ps", "-A")
        assert ps.returncode == 0, ps.stderr
        assert any(" 4242 " in line and " train " in line for line in ps.stdout.splitlines())
        assert gpuusage("ps", "-n", world.ns).returncode == 0
        viewer, _ = api_client(kubeconfig)
        with viewer:
            patch = {"metadata": {"labels": {"example.com/x": "1"}}}
            _denied(lambda: client.CustomObjectsApi(viewer).patch_cluster_custom_object(
                *group, world.a, patch
            ))  # fmt: skip
            _denied(lambda: client.CoreV1Api(viewer).list_namespaced_secret(world.ns))
    finally:
        rbac.delete_cluster_role_binding(sa)
