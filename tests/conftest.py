"""Shared fixtures: one real local control plane per test session.

The control plane is built from Go modules on first use (cached outside the repository) and
tied to this process with PR_SET_PDEATHSIG, so even a killed test run leaves no etcd or
kube-apiserver behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crds
from gpuusage.retry import poll_until
from gpuusage_dev.localcluster.cluster import LocalCluster, free_port
from gpuusage_dev.localcluster.containerd import Containerd, mounts_below, node_prerequisites
from gpuusage_dev.localcluster.images import Platform
from gpuusage_dev.localcluster.platforms import HOST, RELEASE_PLATFORMS
from gpuusage_dev.proctree import pod_cgroup, write_process
from gpuusage_dev.simulation import Background, create_running_pod, ensure_namespace
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.main import Operator
from gpuusage_operator.settings import OperatorSettings
from tests.fakenvml import gpu_uuid
from tests.simworld import SimWorld

pytest_plugins = ["tests.ciguard"]  # CI fails when the real node's tests were skipped

GPU0, GPU1 = gpu_uuid(0), gpu_uuid(1)

# Child processes (the CLI under test) must import the same gpuusage as this test run.
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
CHART = Path(__file__).resolve().parents[1] / "charts" / "gpuusage"
"""The Helm chart's folder."""


def gpuusage_cli(
    kubeconfig: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The user CLI in a child process, as a user runs it (`gpuusage ARGS --kubeconfig K`);
    its exit status is the caller's to judge."""
    return subprocess.run(
        [sys.executable, "-m", "gpuusage.cli", *args, "--kubeconfig", str(kubeconfig)],
        capture_output=True,
        text=True,
        check=False,
        env={**CHILD_ENV, **(env or {})},
    )


def wait_for(predicate: Callable[[], Any], timeout: float = 45.0, what: str = "condition") -> Any:
    """Poll until predicate returns something truthy; an API error or a missing field
    (the object is not there yet) counts as not yet. Fails the test at the timeout."""

    def probe() -> Any:
        try:
            return predicate()
        except (ApiException, KeyError, IndexError, TypeError, StopIteration):
            return None

    value = poll_until(probe, timeout, 0.1)
    if not value:
        raise AssertionError(f"timed out waiting for {what}")
    return value


class Kubectl:
    """kubectl of the same version as the apiserver, pointed at the test cluster."""

    def __init__(self, binary: Path, kubeconfig: Path) -> None:
        self.base = [str(binary), f"--kubeconfig={kubeconfig}"]

    def run(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, input=stdin, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}")
        return proc.stdout + proc.stderr if not check else proc.stdout


class Helm:
    """helm, built at its pinned version, with its own config and cache folders (a developer's
    repositories and plugins stay out of the tests), pointed at the test cluster when given."""

    def __init__(self, binary: Path, home: Path, kubeconfig: Path | None = None) -> None:
        self.base = [str(binary)] + ([f"--kubeconfig={kubeconfig}"] if kubeconfig else [])
        self.env = {
            **os.environ,
            **{
                f"HELM_{kind}_HOME": str(home / kind.lower())
                for kind in ("CACHE", "CONFIG", "DATA")
            },
        }

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, env=self.env, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
        return proc


BUILT_TOOLS = {"cluster": "cluster", "helm_binary": "slow"}
"""Fixtures that need what the tests build from Go modules, and the marker a test using one
gets: `make check`, the inner loop, runs neither."""


COMPAT_MODULES = frozenset(
    {
        "test_install.py",
        "test_api_on_cluster.py",
        "test_allocation_on_cluster.py",
        "test_dra_versions_on_cluster.py",
        "test_dra_forms_on_cluster.py",
        "test_agent_on_cluster.py",
        "test_operator_on_cluster.py",
        "test_real_drivers_on_cluster.py",
        "test_server_version.py",
        "test_local_node.py",
        "test_node_e2e.py",
        "test_dra_on_node.py",
    }
)
"""The tests of install, allocation, DRA and the real node: `make test-compat` runs them (the
`compat` marker) on every supported Kubernetes release, `make test-oldest` those that need no
node on the oldest."""


MACHINE_GROUP = "machine"
"""The one group of tests that use what this machine has once (the kubelet's device-plugin
socket, containerd's host folders, the CNI bridge): under `pytest -n`, they run one after
another in one worker; every other test runs where a worker is free."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts the control plane is a cluster test, one that runs helm a slow one,
    whether or not it says so; one of COMPAT_MODULES a compat test. For parallel runs
    (`--dist loadgroup`): the node's tests share one group; a test using a module's fixture
    runs in its module's group, so that the fixture (an installed product, a built wheel) is
    made once, not once per worker."""
    for item in items:
        if item.path.name in COMPAT_MODULES:
            item.add_marker(pytest.mark.compat)
        for fixture, marker in BUILT_TOOLS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(getattr(pytest.mark, marker))
        group = _parallel_group(item) if config.pluginmanager.hasplugin("xdist") else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after xdist has written the groups into the items' ids
def pytest_collection_finish(session: pytest.Session) -> None:
    """A parallel run in which a test did not get its group (xdist's loadgroup silently
    groups nothing on some pytest releases) fails that test at once with the reason, rather
    than letting the node's tests wait on each other's node and time out far from the cause
    (a worker's collection error would be lost in xdist's internal error)."""
    if not session.config.getoption("loadgroup", default=False):
        return
    for item in session.items:
        group = _parallel_group(item)
        if group and "@" not in item.nodeid:
            item.stash[UNGROUPED] = group


def pytest_runtest_setup(item: pytest.Item) -> None:
    if UNGROUPED in item.stash:
        pytest.fail(
            f"--dist loadgroup did not put this test in its group ({item.stash[UNGROUPED]}): "
            "this pytest-xdist does not group on this pytest (see pyproject.toml's pin)",
            pytrace=False,
        )


def _parallel_group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("node") is not None:
        return MACHINE_GROUP
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d.scope == "module" for chain in defs for d in chain):
        return item.nodeid.split("::", 1)[0]
    return None


def release_test_platforms() -> tuple[Platform, ...]:
    """The platforms the release tests build: this machine's own (CI's short form), or, with
    GPUUSAGE_RELEASE_PLATFORMS=all, every release platform, the others under qemu (`make
    test-release`)."""
    every = os.environ.get("GPUUSAGE_RELEASE_PLATFORMS") == "all"
    return RELEASE_PLATFORMS if every else (HOST,)


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    from gpuusage_dev.localcluster.tools import HELM, ensure_tool  # noqa: PLC0415

    return ensure_tool(HELM)


@pytest.fixture(scope="module")
def helm(helm_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """helm with a home of its own, rendering only (no cluster)."""
    return Helm(helm_binary, tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def kustomize() -> Kubectl:
    """kubectl for `kustomize` alone: it builds, and talks to nothing."""
    from gpuusage_dev.localcluster.binaries import ensure_binaries  # noqa: PLC0415

    return Kubectl(ensure_binaries().kubectl, Path("/nonexistent"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), tie_to_parent=True)
    local.up()
    try:
        api, _ = api_client(local.kubeconfig)
        with api:
            install_crds(api)
        yield local
        deprecated = local.requested_deprecated_apis()
        assert not deprecated, (
            "the product or the tests requested deprecated APIs of Kubernetes "
            f"{local.kubernetes_version}: {'; '.join(deprecated)}"
        )
    finally:
        local.down()


@pytest.fixture(scope="session")
def monitoring_kinds(cluster: LocalCluster) -> None:
    """The Prometheus Operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule) on the
    cluster, from its Go module at the pinned version: the apiserver then checks the shipped
    monitoring objects against the real schemas."""
    from gpuusage_dev.localcluster.tools import monitoring_crds  # noqa: PLC0415

    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    for path in monitoring_crds():
        kubectl.run("apply", "--server-side", "-f", str(path))
    for plural in ("servicemonitors", "podmonitors", "prometheusrules"):
        kubectl.run(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            f"crd/{plural}.monitoring.coreos.com",
        )


@pytest.fixture
def api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    api, _ = api_client(cluster.kubeconfig)
    with api:
        yield api


@pytest.fixture
def kubectl(cluster: LocalCluster) -> Kubectl:
    return Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)


def token_kubeconfig(
    cluster: LocalCluster,
    core: client.CoreV1Api,
    namespace: str,
    sa: str,
    pod: client.V1Pod | None,
    *,
    path: Path,
) -> Path:
    """Mint a token for a ServiceAccount (bound to pod when given) and write a kubeconfig that
    uses it: the program under test then has exactly the rights the manifests grant."""
    spec: dict[str, Any] = {"audiences": [], "expirationSeconds": 3600}
    if pod is not None:
        assert pod.metadata is not None
        spec["boundObjectRef"] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": pod.metadata.name,
            "uid": pod.metadata.uid,
        }
    issued = core.create_namespaced_service_account_token(
        sa, namespace, client.AuthenticationV1TokenRequest(spec=spec)
    )
    assert issued.status is not None
    return token_config(cluster, sa, str(issued.status.token), path)


def token_config(cluster: LocalCluster, user: str, token: str, path: Path) -> Path:
    """A kubeconfig at `path` that speaks to the cluster with this bearer token alone."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": cluster.server,
                    "certificate-authority": str(cluster.directory / "pki" / "ca.crt"),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "local", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    return path


WorldFactory = Callable[..., SimWorld]


@pytest.fixture
def make_world(
    cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> Iterator[WorldFactory]:
    """Builds a simulated GPU node with running pods, its agent and a standalone operator.

    Pods: name → GPUs requested; each gets a pid (train 4242, notebook 5151, others 6000+);
    `pod_extras` adds to a pod what create_running_pod takes (annotations, claims, templates);
    `operator_extras` and `agent_extras`, settings of the operator and of the agent;
    `leases`: the operator watches Leases in the world's namespace, and (`agent_lease`) the
    agent renews its Lease there (every third of a 10 s Lease; an unchanged report is refreshed
    after 60 s). `stale_after` None: the operator judges a node by its Lease's duration.
    `write(notebook=True)` puts train on GPU0 (with Xorg) and the notebook on GPU1;
    `scenario(gpus)` writes any other scenario. operator=False: no operator of its own (a second
    node beside a world that has one).
    """
    running: list[Background] = []  # halted in this order at the end

    def build(
        pods: dict[str, int] | None = None,
        *,
        idle_after: float = 1800.0,
        operator: bool = True,
        attribution_grace: float = 120.0,
        stale_after: float | None = 4.0,
        pod_extras: dict[str, dict[str, Any]] | None = None,
        operator_extras: dict[str, Any] | None = None,
        agent_extras: dict[str, Any] | None = None,
        leases: bool = False,
        agent_lease: bool = False,
    ) -> SimWorld:
        core = client.CoreV1Api(api)
        ns = f"ml-{uuid.uuid4().hex[:6]}"
        node = f"gpu-{uuid.uuid4().hex[:6]}"
        ensure_namespace(core, ns)
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
        proc = tmp_path / f"proc-{node}"
        write_process(proc, 777, "0::/system.slice/display-manager.service", comm="Xorg")
        pids: dict[str, int] = {}
        uids: dict[str, str] = {}
        for i, (name, gpus) in enumerate((pods or {"train": 1, "notebook": 1}).items()):
            container = {"train": "trainer", "notebook": "jupyter"}.get(name, f"{name}-ctr")
            extras = (pod_extras or {}).get(name, {})
            uid, cid = create_running_pod(core, ns, name, node, container, gpus=gpus, **extras)
            pids[name] = {"train": 4242, "notebook": 5151}.get(name, 6000 + i)
            uids[name] = uid
            write_process(
                proc, pids[name], pod_cgroup(uid, cid), comm="python3", start_ticks=pids[name]
            )
        scenario_file = tmp_path / f"scenario-{node}.yaml"

        def scenario(gpus: list[dict[str, Any]]) -> None:
            # Atomically, as an editor saves: the agent reads the file while it is written.
            fresh = scenario_file.with_suffix(".new")
            fresh.write_text(yaml.safe_dump({"gpus": gpus}))
            fresh.replace(scenario_file)

        def write(notebook: bool = True) -> None:
            gpu0 = [{"pid": 4242, "usedMemoryMiB": 30720}, {"pid": 777, "usedMemoryMiB": 512}]
            scenario(
                [
                    {"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": gpu0},
                    {
                        "index": 1,
                        "uuid": GPU1,
                        "memoryTotalMiB": 81920,
                        "processes": [{"pid": 5151, "usedMemoryMiB": 10240}] if notebook else [],
                    },
                ]
            )

        write()
        agent_settings = AgentSettings(
            node_name=node,
            interval=0.3,
            heartbeat=1.0,
            gpu_source=f"fake:{scenario_file}",
            proc_root=proc,
            kubeconfig=cluster.kubeconfig,
            metrics_port=0,
            attribution_grace=attribution_grace,
            **(
                {"lease_namespace": ns, "lease_duration": 10, "report_refresh": 60}
                if agent_lease
                else {}
            ),
            **(agent_extras or {}),
        )
        agent = Background(lambda stop: run_agent(agent_settings, stop))
        running.append(agent)
        world = SimWorld(
            api=api,
            core=core,
            ns=ns,
            node=node,
            pids=pids,
            uids=uids,
            proc=proc,
            scenario_file=scenario_file,
            write=write,
            scenario=scenario,
            agent=agent,
        )
        if operator:
            ready = threading.Event()
            metrics_port = free_port()
            op_settings = OperatorSettings(
                kubeconfig=cluster.kubeconfig,
                stale_after=stale_after,
                resync=0.5,
                standalone=True,
                metrics_port=metrics_port,
                metrics_address="127.0.0.1",
                idle_after=idle_after,
                **({"lease_namespace": ns} if leases else {}),
                **(operator_extras or {}),
            )
            built = Operator(op_settings)
            serving = Background(lambda stop: built.run(stop, ready))
            running.append(serving)
            world = replace(world, operator=serving, built=built, metrics_port=metrics_port)
            assert ready.wait(60), "operator did not become ready"
        return world

    try:
        yield build
    finally:
        for part in running:
            part.halt()


@pytest.fixture
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    """A containerd of our own, started in a short folder (its sockets live there; a test's
    own tmp_path can be too deep), stopped with nothing of it left mounted."""
    why = node_prerequisites()
    if why is not None:
        pytest.skip(why)
    runtime = Containerd(tmp_path_factory.mktemp("ctr") / "containerd")
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()
        assert mounts_below(runtime.directory) == [], "nothing left mounted"
