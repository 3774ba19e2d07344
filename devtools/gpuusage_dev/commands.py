"""The development commands: `gpuusage demo` and `gpuusage local-cluster up|down|restart|build`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from gpuusage.settings import CommandSettings

if TYPE_CHECKING:
    from gpuusage_dev.localcluster.cluster import LocalCluster


class LocalClusterSettings(CommandSettings):
    dir: Path
    """Folder for the cluster's state, certificates, logs and kubeconfig."""
    install_crds: bool = False
    """After start, install the CRDs (GpuNodeUsage, GpuUsagePolicy) and wait until they are
    established."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for the apiserver's /readyz (and the node's readiness)."""
    node: str | None = None
    """Also run one real node of this name: kube-scheduler, kube-controller-manager,
    containerd, runc, a CNI bridge, a kubelet confined as system:node:NAME (Node authorizer,
    NodeRestriction) and a device plugin advertising the GPUs of --gpus. Needs root and the
    distribution's runc, containernetworking-plugins and busybox-static (containerd is built
    from Go modules)."""
    gpus: Path | None = None
    """The node's GPU scenario (the fake source's format) for its device plugin or DRA driver;
    default: four whole GPUs."""
    gpu_allocation: Literal["device-plugin", "dra"] = "device-plugin"
    """Who hands out the node's GPUs: our device plugin (`nvidia.com/gpu`), or our DRA driver
    (`gpu.nvidia.com`, with NVIDIA's DeviceClasses; a pod asking `nvidia.com/gpu` gets a GPU
    through a claim the scheduler makes for it), in which case no device plugin runs."""
    kubernetes_version: str | None = None
    """The Kubernetes release to run (a supported minor such as 1.36 names its release);
    default: the newest supported (gpuusage_dev.localcluster.versions)."""


class RestartSettings(CommandSettings):
    dir: Path
    """Folder of a running local cluster (as given to `up`)."""
    component: Literal["apiserver", "etcd", "kubelet", "containerd", "device-plugin"] | None = None
    """Restart only this component; default both etcd and the apiserver (the apiserver stops
    first, starts last). The node's parts (a cluster started with --node) crash with SIGKILL,
    as on a real node, and start again: running containers survive the kubelet's and
    containerd's crash."""
    down_for: float = Field(default=0.0, ge=0)
    """Seconds a node part stays down before it starts again (a kubelet away for an upgrade)."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for the part to be back: the apiserver's /readyz; the node Ready with
    every device the plugin lists."""

    @model_validator(mode="after")
    def _down_for_a_node_part(self) -> RestartSettings:
        if self.down_for and self.component in (None, "apiserver", "etcd"):
            raise ValueError(
                "--down-for is for the node's parts: kubelet, containerd, device-plugin"
            )
        return self


class BuildSettings(CommandSettings):
    """Versions are pinned in gpuusage_dev.localcluster.versions, .binaries and .tools."""

    tools: bool = False
    """Also build kube-state-metrics, promtool, Prometheus, helm, krew and actionlint and fetch
    the Prometheus Operator's CRDs (the monitoring, bill and Helm chart tests and lint use
    them)."""
    node: bool = False
    """Also build the kubelet, kube-scheduler and kube-controller-manager (a real node)."""
    kubernetes_version: str | None = None
    """The Kubernetes release to build (a supported minor such as 1.36 names its release);
    default: the newest supported (gpuusage_dev.localcluster.versions)."""


class DemoSettings(CommandSettings):
    dir: Path | None = None
    """Folder for the demo cluster; a temporary one by default."""
    keep: bool = False
    """Leave the demo cluster running at the end (stop it with `local-cluster down`; on a real
    node, until Enter is pressed)."""
    simulated: bool = False
    """Run the simulated node even where this machine can run a real one."""


def run_up(settings: LocalClusterSettings) -> int:
    from gpuusage.kube.config import api_client  # noqa: PLC0415
    from gpuusage.kube.crds import install_crds  # noqa: PLC0415
    from gpuusage_dev.localcluster.cluster import LocalCluster  # noqa: PLC0415

    if settings.node is None:
        cluster = LocalCluster(settings.dir, kubernetes_version=settings.kubernetes_version)
        cluster.up(timeout=settings.timeout)
    else:
        cluster = _up_with_node(settings, settings.node)
    if settings.install_crds:
        api, _ = api_client(cluster.kubeconfig)
        with api:
            install_crds(api)
    print(
        f"local control plane (Kubernetes {cluster.kubernetes_version}) ready at {cluster.server}"
    )
    if settings.node is not None:
        print(f"node {settings.node} Ready (its files and logs in {settings.dir / 'node'})")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"kubectl: {cluster.binaries.kubectl}")
    print(f"stop it with: gpuusage local-cluster down --dir {settings.dir}")
    return 0


def _up_with_node(settings: LocalClusterSettings, name: str) -> LocalCluster:
    import yaml  # noqa: PLC0415

    from gpuusage_dev.localcluster.containerd import NodeUnavailable  # noqa: PLC0415
    from gpuusage_dev.localcluster.node import Node, cannot_run_node, node_cluster  # noqa: PLC0415

    why = cannot_run_node(product=True)
    if why is not None:
        raise NodeUnavailable(f"cannot run node {name} here: {why}")
    scenario = yaml.safe_load(settings.gpus.read_text()) if settings.gpus else None
    cluster = node_cluster(settings.dir, kubernetes_version=settings.kubernetes_version)
    cluster.up(timeout=settings.timeout)
    node = Node(
        settings.dir / "node",
        name,
        server=cluster.server,
        pki=settings.dir / "pki",
        scenario=scenario,
        product=True,
        kubernetes_version=cluster.kubernetes_version,
        gpu_allocation=settings.gpu_allocation,
    )
    try:
        node.start(settings.timeout)
        node.install_device_classes(cluster.binaries.kubectl, cluster.kubeconfig)
        node.wait_ready(cluster.binaries.kubectl, cluster.kubeconfig, settings.timeout)
    except BaseException:
        node.stop()
        cluster.down()
        raise
    return cluster


def run_down(settings: LocalClusterSettings) -> int:
    from gpuusage_dev.localcluster.cluster import LocalCluster  # noqa: PLC0415
    from gpuusage_dev.localcluster.node import Node  # noqa: PLC0415

    node = Node(settings.dir / "node")
    if node.state_path.exists():
        node.stop()  # before the control plane: its kubelet would wait for the apiserver
        print(f"stopped the node in {node.directory}")
    stopped = LocalCluster(settings.dir).down()
    names = ", ".join(f"{p.name} (pid {p.pid})" for p in stopped) or "nothing was running"
    print(f"stopped: {names}")
    return 0


def run_restart(settings: RestartSettings) -> int:
    from gpuusage_dev.localcluster.cluster import LocalCluster  # noqa: PLC0415
    from gpuusage_dev.localcluster.node import NODE_COMPONENTS, Node  # noqa: PLC0415

    cluster = LocalCluster(settings.dir)
    component = settings.component
    if component is None or component in ("apiserver", "etcd"):
        cluster.restart(component, timeout=settings.timeout)
        what = component or "etcd and kube-apiserver"
        print(f"restarted {what}; local control plane ready at {cluster.server}")
        return 0
    assert component in NODE_COMPONENTS
    node = Node.load(settings.dir / "node")
    node.restart(component, settings.down_for, settings.timeout)
    node.wait_ready(cluster.binaries.kubectl, cluster.kubeconfig, settings.timeout)
    print(f"crashed and restarted the node's {component}; node {node.name} Ready")
    return 0


def run_build(settings: BuildSettings) -> int:
    from gpuusage_dev.fakekubelet import ensure_fake_kubelet  # noqa: PLC0415
    from gpuusage_dev.localcluster import versions  # noqa: PLC0415
    from gpuusage_dev.localcluster.binaries import (  # noqa: PLC0415
        ensure_binaries,
        ensure_node_binaries,
    )
    from gpuusage_dev.localcluster.tools import (  # noqa: PLC0415
        CONTAINERD,
        OPENREPORTS_CRDS,
        PROMETHEUS_OPERATOR_CRDS,
        TOOLS,
        crds,
        ensure_tool,
        first_build_plan,
    )
    from gpuusage_dev.localprometheus import ensure_bcrypt_hash  # noqa: PLC0415

    version = versions.choose(settings.kubernetes_version)
    plan = first_build_plan(settings.node, settings.tools, version=version)
    if plan:
        print(plan, file=sys.stderr, flush=True)
    found = ensure_binaries(version=version)
    for path in (found.kube_apiserver, found.etcd, found.kubectl):
        print(path)
    print(ensure_fake_kubelet())  # the demo's and the tests' kubelet PodResources socket
    if settings.node:
        for path in ensure_node_binaries(version=version).all:
            print(path)
        print(ensure_tool(CONTAINERD))
    if settings.tools:
        for tool in TOOLS:
            print(ensure_tool(tool))
        print(ensure_bcrypt_hash())  # the local Prometheus' basic auth
        for source in (PROMETHEUS_OPERATOR_CRDS, OPENREPORTS_CRDS):
            for crd in crds(source):
                print(crd)
    return 0


def run_demo(settings: DemoSettings) -> int:
    """On a real node where this machine can run one (it says which it runs), else on the
    simulated node."""
    from gpuusage_dev.localcluster.node import cannot_run_node  # noqa: PLC0415

    why = "--simulated" if settings.simulated else cannot_run_node(product=True)
    if why is None:
        from gpuusage_dev.nodedemo import run_node_demo  # noqa: PLC0415

        print("gpuusage demo: on a real node (kubelet, containerd, runc; simulated GPUs)")
        return run_node_demo(settings.dir, keep=settings.keep)
    from gpuusage_dev.demo import run_demo as demo  # noqa: PLC0415

    print(f"gpuusage demo: on a simulated node (no real node here: {why})")
    return demo(settings.dir, keep=settings.keep)
