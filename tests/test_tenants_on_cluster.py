"""Tenants see their own: `gpuusage top -n` and `ps -n` for a user who may read only the pods
of one namespace, on the real apiserver, from the marks the real operator wrote on them; what
only the reports can answer is refused with the right it needs. And the README's headline
command, run with the real kubectl, shows those marks as the README shows them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage_dev.localcluster.cluster import LocalCluster
from tests.conftest import (
    GPU0,
    GPU1,
    WorldFactory,
    gpuusage_cli,
    token_kubeconfig,
    wait_for,
)
from tests.simworld import SimWorld
from tests.worldview import condition, pod, pod_annotations, report

pytestmark = pytest.mark.cluster

README = Path(__file__).resolve().parents[1] / "README.md"
TENANT = "tenant"


@pytest.fixture
def world(make_world: WorldFactory) -> SimWorld:
    """A node whose trainer was handed its GPU and whose notebook was handed none; both marked
    by the operator."""
    world = make_world({"train": 1, "notebook": 0})

    def marked() -> bool:
        reasons = {name: condition(pod(world, name)).reason for name in ("train", "notebook")}
        return reasons == {"train": "ProcessesRunning", "notebook": "UsingUnrequestedGPU"}

    wait_for(marked, what="both pods marked")
    return world


def _tenant(cluster: LocalCluster, world: SimWorld, path: Path) -> Path:
    """A kubeconfig for a ServiceAccount that may get and list the pods of the world's
    namespace, and nothing else; its context's namespace is that one."""
    ns = world.ns
    world.core.create_namespaced_service_account(
        ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=TENANT))
    )
    rbac = client.RbacAuthorizationV1Api(world.api)
    rule = client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list"])
    rbac.create_namespaced_role(
        ns, client.V1Role(metadata=client.V1ObjectMeta(name="pod-reader"), rules=[rule])
    )
    rbac.create_namespaced_role_binding(
        ns,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="tenant-pod-reader"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"
            ),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=TENANT, namespace=ns)],
        ),
    )
    kubeconfig = token_kubeconfig(cluster, world.core, ns, TENANT, None, path=path)
    config = yaml.safe_load(kubeconfig.read_text())
    config["contexts"][0]["context"]["namespace"] = ns
    kubeconfig.write_text(yaml.safe_dump(config))
    return kubeconfig


def _table(text: str) -> list[dict[str, str]]:
    """kubectl-style columns as dicts by header, each cell where its header starts."""
    header, *lines = text.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{header[a:b].strip(): line[a:b].strip() for a, b in bounds} for line in lines]


def test_a_tenant_sees_their_namespace_from_its_pods_marks(
    cluster: LocalCluster, world: SimWorld, tmp_path: Path
) -> None:
    tenant = _tenant(cluster, world, tmp_path / "tenant.kubeconfig")
    top = gpuusage_cli(tenant, "top", "-n", world.ns)
    assert top.returncode == 0, top.stderr
    (said,) = top.stderr.splitlines()
    assert said.startswith(f"note: no right to list {names.PLURAL}: namespace {world.ns} as ")
    assert "only the reports show processes of no pod, other namespaces" in said
    rows = {r["NAME"]: r for r in _table(top.stdout)}
    assert sorted(rows) == ["notebook", "train"]
    assert [rows["train"][k] for k in ("NODE", "GPUS", "ALLOCATED", "MEMORY", "DEVICES")] == [
        *[world.node, "1", "1", "30Gi", GPU0]
    ]
    assert rows["train"]["PROCESSES"] == "1"
    assert [rows["notebook"][k] for k in ("GPUS", "ALLOCATED", "MEMORY", "DEVICES")] == [
        *["1", "0 (none!)", "10Gi", GPU1]
    ], "the pod handed no GPU is marked as the reports' view marks it"

    # What an admin sees of the same pods from the reports: the same rows.
    admin = gpuusage_cli(cluster.kubeconfig, "top", "-n", world.ns)
    assert admin.returncode == 0, admin.stderr
    assert admin.stdout == top.stdout

    # The context's namespace without -n, as kubectl; JSON says where the rows come from.
    shown = json.loads(gpuusage_cli(tenant, "top", "-o", "json").stdout)
    assert shown["view"] == "pod-marks"
    assert [(i["pod"], i["memory_mib"], i["unrequested"]) for i in shown["items"]] == [
        ("train", 30720, False),
        ("notebook", 10240, True),
    ]

    ps = gpuusage_cli(tenant, "ps", "-n", world.ns)
    assert ps.returncode == 0, ps.stderr
    assert "each process's command, own memory, activity and device number" in ps.stderr
    processes = [
        (r["PIDS"], r["POD"], r["CONTAINER"], r["DEVICE"], r["MEMORY"]) for r in _table(ps.stdout)
    ]
    assert processes == [
        (str(world.pids["train"]), "train", "trainer", GPU0, "30Gi"),
        (str(world.pids["notebook"]), "notebook", "jupyter", GPU1, "10Gi"),
    ]
    on_node = gpuusage_cli(tenant, "ps", "-n", world.ns, "--node", "elsewhere")
    assert (on_node.returncode, on_node.stdout) == (0, "")
    assert "No GPU processes in namespace" in on_node.stderr


def test_what_only_the_reports_answer_is_refused_naming_the_right(
    cluster: LocalCluster, world: SimWorld, tmp_path: Path
) -> None:
    tenant = _tenant(cluster, world, tmp_path / "tenant.kubeconfig")
    viewer = "ask for the gpuusage-viewer ClusterRole"
    for args, says in (
        (("top", "-A"), "which -A needs"),
        (("ps", "-A"), "which -A needs"),
        (("ps", "--node", world.node), "which every process of a node (--node without -n)"),
        (("top", "--by", "namespace", "-n", world.ns), "which --by namespace sums"),
        (("top", "-n", "default"), "nor pods in namespace default"),
        (("ps", "-n", "default"), "nor pods in namespace default"),
    ):
        refused = gpuusage_cli(tenant, *args)
        assert refused.returncode == 1, (args, refused.stdout)
        (line,) = refused.stderr.splitlines()
        assert line.startswith(f"gpuusage: cannot list {names.PLURAL} (cluster-scoped)"), line
        assert says in line, line
        assert viewer in line, line
        assert refused.stdout == ""


def test_a_tenant_of_an_observed_namespace_is_told_why_no_pod_shows_use(
    cluster: LocalCluster, make_world: WorldFactory, tmp_path: Path
) -> None:
    """Observe first: the operator writes on no pod, so a tenant's `top -n` and `ps -n` from
    the marks find none. They say that, and where the use shows, not that no pod uses GPUs:
    the reports show the trainer using its GPU."""
    world = make_world({"train": 1}, operator_extras={"pod_marks": False})
    wait_for(
        lambda: [
            p for p in (report(world).get("status") or {}).get("pods") or [] if p["name"] == "train"
        ],
        what="the reports show the trainer",
    )
    tenant = _tenant(cluster, world, tmp_path / "tenant.kubeconfig")
    says = (
        f"None of the pods in namespace {world.ns} carries gpuusage's marks: the operator may "
        "observe only (operator.podMarks=false)"
    )
    for command in ("top", "ps"):
        shown = gpuusage_cli(tenant, command, "-n", world.ns)
        assert (shown.returncode, shown.stdout) == (0, ""), shown.stderr
        assert says in shown.stderr, shown.stderr
        assert "ClusterRole gpuusage-viewer" in shown.stderr
        assert "No pods use GPUs" not in shown.stderr
        assert "No GPU processes" not in shown.stderr
    admin = gpuusage_cli(cluster.kubeconfig, "top", "-n", world.ns)
    assert admin.returncode == 0, admin.stderr
    assert [r["NAME"] for r in _table(admin.stdout)] == ["train"], "the reports show the use"


def _headline() -> tuple[str, list[str]]:
    """The README's first example: its command (as bash takes it, continuation and all) and the
    lines it shows that command printing."""
    block = README.read_text().split("```\n", 2)[1]
    script: list[str] = []
    shown: list[str] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            if shown:
                break
            script.append(line[2:])
        elif script and script[-1].endswith("\\"):
            script.append(line)
        elif line:
            shown.append(line)
    return "\n".join(script), shown


def test_the_readmes_headline_command_shows_the_marks_as_the_readme_does(
    cluster: LocalCluster, world: SimWorld
) -> None:
    script, shown = _headline()
    assert "kubectl get pods" in script
    kubectl = cluster.binaries.kubectl
    env = {
        **os.environ,
        "PATH": f"{kubectl.parent}{os.pathsep}{os.environ['PATH']}",
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    printed = subprocess.run(
        ["bash", "-c", f"set -e\n{script}"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    header, *rows = printed.splitlines()
    assert header.split() == shown[0].split()
    ours = [r.split() for r in rows if r.startswith(world.ns + " ")]
    memory = pod_annotations(world, "train")[names.ANNOTATION_GPU_MEMORY_MIB]
    assert ours == [
        [world.ns, "notebook", GPU1, "10240", "True", "UsingUnrequestedGPU"],
        [world.ns, "train", GPU0, memory, "True", "ProcessesRunning"],
    ]
    assert len(shown[1].split()) == len(header.split()), "the README's rows have every column"
