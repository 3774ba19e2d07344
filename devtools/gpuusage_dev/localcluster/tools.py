"""kube-state-metrics, promtool and Prometheus, helm, krew and actionlint at pinned versions,
built from Go modules like the apiserver.

The monitoring configuration and the Helm chart ship as data (a CustomResourceStateMetrics
config, alert rules, templates); the only proof that they work is running the real programs on
them. Each is built once into the same cache as the control plane, keyed by version, under the
same lock. A prebuilt binary can be named instead with $GPUUSAGE_KUBE_STATE_METRICS,
$GPUUSAGE_PROMTOOL, $GPUUSAGE_PROMETHEUS_BINARY, $GPUUSAGE_HELM, $GPUUSAGE_KREW or
$GPUUSAGE_ACTIONLINT. The release's tools (crane, the Distribution registry, cosign, syft;
$GPUUSAGE_CRANE, $GPUUSAGE_REGISTRY, $GPUUSAGE_COSIGN, $GPUUSAGE_SYFT) are built the same way
when the release first needs them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from gpuusage_dev.localcluster.binaries import (
    BinariesError,
    Progress,
    absent,
    cache_root,
    cached_binaries,
    cached_node_binaries,
    file_lock,
    go_build,
    go_env,
    missing_binaries,
    module_download,
    require_go,
    stderr_progress,
)

VERSION_PACKAGE = "github.com/prometheus/common/version"


@dataclass(frozen=True)
class Tool:
    """A Go program built from a throwaway module that requires its module at one version."""

    name: str
    module: str
    version: str
    package: str
    shown_version: str
    """What the binary says its version is."""
    env: str
    """Environment variable naming a prebuilt binary to use instead."""
    version_variable: str = f"{VERSION_PACKAGE}.Version"
    """The Go variable the release build sets to `shown_version` (a module build leaves it at
    its development default)."""
    companions: tuple[str, ...] = ()
    """More packages of the module built beside it, into the same folder (a daemon's shim and
    its command-line client)."""
    tags: str = ""
    """Go build tags."""
    cgo: bool = False
    """Built with cgo (a C compiler needed), for a module that links a C library's headers."""

    @property
    def folder(self) -> str:
        return f"{self.name}-{self.version}"

    def cached(self, root: Path | None = None) -> Path:
        return (root or cache_root()) / "bin" / self.folder / self.name


# Newer versions of both are refused by the Go module proxy this project builds against.
KUBE_STATE_METRICS = Tool(
    name="kube-state-metrics",
    module="k8s.io/kube-state-metrics/v2",
    version="v2.13.0",
    package="k8s.io/kube-state-metrics/v2",
    shown_version="v2.13.0",
    env="GPUUSAGE_KUBE_STATE_METRICS",
)
PROMTOOL = Tool(
    name="promtool",
    module="github.com/prometheus/prometheus",
    version="v0.305.0",  # Prometheus 3.5.0, the current long-term-support release line
    package="github.com/prometheus/prometheus/cmd/promtool",
    shown_version="3.5.0",
    env="GPUUSAGE_PROMTOOL",
)
PROMETHEUS = Tool(
    name="prometheus",
    module=PROMTOOL.module,
    version=PROMTOOL.version,
    package="github.com/prometheus/prometheus/cmd/prometheus",
    shown_version=PROMTOOL.shown_version,
    env="GPUUSAGE_PROMETHEUS_BINARY",
)
"""The server of promtool's release: `gpuusage top --window` is proven against its HTTP API
behind basic auth and TLS (its web UI's assets are not built in: the API needs none). Its
variable is not $GPUUSAGE_PROMETHEUS, which is `gpuusage top`'s --prometheus URL."""
HELM = Tool(
    name="helm",
    module="helm.sh/helm/v4",
    version="v4.3.1",
    package="helm.sh/helm/v4/cmd/helm",
    shown_version="v4.3.1",
    env="GPUUSAGE_HELM",
    version_variable="helm.sh/helm/v4/internal/version.version",
)
KREW = Tool(
    name="kubectl-krew",
    module="sigs.k8s.io/krew",
    version="v0.4.3",
    package="sigs.k8s.io/krew/cmd/krew",
    shown_version="v0.4.3",
    env="GPUUSAGE_KREW",
    version_variable="sigs.k8s.io/krew/internal/version.gitTag",
)
"""kubectl's plugin manager, to install the gpuusage plugin from its manifest as users do."""
ACTIONLINT = Tool(
    name="actionlint",
    module="github.com/rhysd/actionlint",
    version="v1.7.12",
    package="github.com/rhysd/actionlint/cmd/actionlint",
    shown_version="v1.7.12",
    env="GPUUSAGE_ACTIONLINT",
    version_variable="github.com/rhysd/actionlint.version",
)
"""The hosted workflows' checker (.github/workflows): their syntax, expressions, permissions
and the actions they call, which nothing else reads before GitHub runs them."""
TOOLS = (KUBE_STATE_METRICS, PROMTOOL, PROMETHEUS, HELM, KREW, ACTIONLINT)
CRANE = Tool(
    name="crane",
    module="github.com/google/go-containerregistry",
    version="v0.22.1",
    package="github.com/google/go-containerregistry/cmd/crane",
    shown_version="v0.22.1",
    env="GPUUSAGE_CRANE",
    version_variable="github.com/google/go-containerregistry/cmd/crane/cmd.Version",
)
"""Pushes the release's image indexes (OCI layouts) to a registry and reads them back."""
REGISTRY = Tool(
    name="registry",
    module="github.com/distribution/distribution/v3",
    version="v3.1.2",
    package="github.com/distribution/distribution/v3/cmd/registry",
    shown_version="v3.1.2",
    env="GPUUSAGE_REGISTRY",
    version_variable="github.com/distribution/distribution/v3/version.version",
)
"""The CNCF Distribution registry, on loopback: where the release is proven end to end."""
COSIGN = Tool(
    name="cosign",
    module="github.com/sigstore/cosign/v3",
    version="v3.1.3",
    package="github.com/sigstore/cosign/v3/cmd/cosign",
    shown_version="v3.1.3",
    env="GPUUSAGE_COSIGN",
    version_variable="sigs.k8s.io/release-utils/version.gitVersion",
)
"""Signs the images and the chart, attaches the SBOM and provenance as signed attestations,
and verifies them as users do."""
SYFT = Tool(
    name="syft",
    module="github.com/anchore/syft",
    version="v1.57.1",
    package="github.com/anchore/syft/cmd/syft",
    shown_version="1.57.1",
    env="GPUUSAGE_SYFT",
    version_variable="main.version",
)
"""Lists what each image holds (its Debian packages and Python distributions) as an SBOM."""
RELEASE_TOOLS = (CRANE, REGISTRY, COSIGN, SYFT)
"""Built on first use by the release and its proof only: no other test needs them."""
CONTAINERD = Tool(
    name="containerd",
    module="github.com/containerd/containerd",
    version="v1.7.35",
    package="github.com/containerd/containerd/cmd/containerd",
    shown_version="v1.7.35",
    env="GPUUSAGE_CONTAINERD",
    version_variable="github.com/containerd/containerd/version.Version",
    companions=(
        "github.com/containerd/containerd/cmd/containerd-shim-runc-v2",
        "github.com/containerd/containerd/cmd/ctr",
    ),
    tags="no_btrfs no_devmapper no_zfs no_aufs",
)
"""The local node's container runtime: 1.7 is the first that hands a container the CDI devices
a DRA driver prepared (`enable_cdi`), which Debian 12's 1.6 ignores; its shim and `ctr` lie
beside it. Statically linked without the snapshotters that need cgo (the node uses overlayfs)."""
NVIDIA_RUNTIME_HOOK = Tool(
    name="nvidia-container-runtime-hook",
    module="github.com/NVIDIA/nvidia-container-toolkit",
    version="v1.20.0",
    package="github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime-hook",
    shown_version="1.20.0",
    env="GPUUSAGE_NVIDIA_RUNTIME_HOOK",
    version_variable="github.com/NVIDIA/nvidia-container-toolkit/internal/info.version",
    cgo=True,  # NVML's headers, through go-nvml
)
"""The NVIDIA container runtime's hook in its legacy mode, which decides from a container's OCI
spec what nvidia-container-cli gives it (the MIG monitor capability among it): the chart's MIG
variant is held to its own rules, not to a reading of them."""


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def ensure_tool(tool: Tool, progress: Progress = stderr_progress) -> Path:
    """The tool's binary: $<env> if set, else the cache, built first when missing."""
    explicit = os.environ.get(tool.env)
    if explicit:
        path = Path(explicit)
        if not _usable(path):
            raise BinariesError(
                f"{tool.env}={explicit} is not an executable file; point it at a {tool.name} "
                f"binary ({tool.version} is tested) or unset it to let gpuusage build one"
            )
        return path
    root = cache_root()
    wanted = tool.cached(root)
    if _usable(wanted):
        return wanted
    go = require_go(
        f"gpuusage builds {tool.name} {tool.version} from Go modules once (a few minutes), or "
        f"set {tool.env} to a prebuilt {tool.name}."
    )
    with file_lock(root / "locks" / "build.lock"):
        if not _usable(wanted):
            build_tool(go, tool, wanted.parent, root / "work", progress)
    if not _usable(wanted):
        raise BinariesError(f"build finished but {wanted} is missing")
    return wanted


def build_tool(go: str, tool: Tool, dest: Path, work: Path, progress: Progress) -> None:
    module = work / tool.folder
    module.mkdir(parents=True, exist_ok=True)
    (module / "go.mod").write_text(
        f"module gpuusage.local/{tool.name}build\n\ngo 1.24.0\n\n"
        f"require {tool.module} {tool.version}\n"
    )
    go_build(
        go,
        module,
        env={**go_env(), "CGO_ENABLED": "1"} if tool.cgo else go_env(),
        packages=[tool.package, *tool.companions],
        ldflags=f"-s -w -X {tool.version_variable}={tool.shown_version}",
        tags=tool.tags,
        dest=dest,
        what=f"{tool.name} {tool.version}",
        progress=progress,
        # go names a binary after its package's last element (a /v2 module's: v2)
        rename={"v2": tool.name, tool.package.rsplit("/", 1)[-1]: tool.name},
    )


@dataclass(frozen=True)
class CrdSource:
    """CRDs shipped in a Go module's source at one version: what the real schemas are."""

    name: str
    module: str
    version: str
    folder: str
    """Where in the module's source the files are."""
    files: tuple[str, ...]

    def cached(self, root: Path | None = None) -> list[Path]:
        folder = (root or cache_root()) / "bin" / f"{self.name}-crds-{self.version}"
        return [folder / name for name in self.files]


PROMETHEUS_OPERATOR_CRDS = CrdSource(
    name="prometheus-operator",
    module="github.com/prometheus-operator/prometheus-operator",
    version="v0.85.0",
    folder="example/prometheus-operator-crd",
    files=tuple(
        f"monitoring.coreos.com_{kind}.yaml"
        for kind in ("servicemonitors", "podmonitors", "prometheusrules")
    ),
)
"""The kinds gpuusage's monitoring ships (ServiceMonitor, PodMonitor, PrometheusRule)."""
OPENREPORTS_CRDS = CrdSource(
    name="openreports",
    module="github.com/openreports/reports-api",
    version="v0.2.1",
    folder="config/crd",
    files=("openreports.io_reports.yaml", "openreports.io_clusterreports.yaml"),
)
"""openreports.io Report and ClusterReport, where the operator publishes its findings."""


KYVERNO_CRDS = CrdSource(
    name="kyverno",
    module="github.com/kyverno/kyverno",
    version="v1.19.1",
    folder="config/crds/policies.kyverno.io",
    files=("policies.kyverno.io_imagevalidatingpolicies.yaml",),
)
"""Kyverno's ImageValidatingPolicy (its ClusterPolicy's verifyImages is deprecated): the schema
docs/install.md's image-verification policy must meet."""


OPENSHIFT_SCC_CRDS = CrdSource(
    name="openshift-scc",
    module="github.com/openshift/api",
    version="v0.0.0-20260817165856-9fda5179a7f7",
    folder="security/v1/zz_generated.crd-manifests",
    files=("0000_03_config-operator_01_securitycontextconstraints.crd.yaml",),
)
"""OpenShift's SecurityContextConstraints (security.openshift.io/v1, as its release-4.22 branch
ships it): the schema the chart's SCC for the agent must meet, on a plain apiserver."""


def crds(source: CrdSource, progress: Progress = stderr_progress) -> list[Path]:
    """The CRDs of `source`, read from its Go module once and then cached.

    Installing the real CRDs lets the apiserver check what gpuusage writes or ships against
    the real schemas, never against a copy kept here.
    """
    root = cache_root()
    wanted = source.cached(root)
    if all(p.is_file() for p in wanted):
        return wanted
    module = f"{source.module}@{source.version}"
    go = require_go(f"gpuusage reads the CRDs of {module} from its Go module once.")
    with file_lock(root / "locks" / "build.lock"):
        progress(f"gpuusage: fetching {module} CRDs ...")
        work = root / "work" / f"{source.name}-crds"
        work.mkdir(parents=True, exist_ok=True)
        (work / "go.mod").write_text("module gpuusage.local/crds\n\ngo 1.24.0\n")
        folder = module_download(go, module, work, go_env(), "Dir") / source.folder
        wanted[0].parent.mkdir(parents=True, exist_ok=True)
        for path in wanted:
            shutil.copyfile(folder / path.name, path)
    return wanted


def monitoring_crds(progress: Progress = stderr_progress) -> list[Path]:
    """The Prometheus Operator's CRDs for the kinds gpuusage ships."""
    return crds(PROMETHEUS_OPERATOR_CRDS, progress)


FIRST_BUILD_MINUTES = {"control plane": 6.0, "node": 3.5, "tools": 8.5}
"""What a first build takes on 2 cores with empty Go caches, measured: kube-apiserver and
kubectl 325 s with their modules' download, etcd 30 s, the node's three programs 90 s more
(sharing the apiserver's packages) and containerd about 2 minutes; the monitoring and
packaging tools about 8 minutes more, actionlint 45 s of it and the Prometheus server 15 s
after promtool, whose packages it shares (a whole first `make test` build took 18.5 minutes
against `make demo`'s 10)."""


def first_build_plan(
    node: bool, tools: bool, root: Path | None = None, version: str | None = None
) -> str | None:
    """What a build is about to make for the first time, and about how long it takes; None
    when everything is cached (or KUBEBUILDER_ASSETS names the control plane's binaries)."""
    root = root or cache_root()
    parts: list[tuple[str, str]] = []
    if not os.environ.get("KUBEBUILDER_ASSETS") and missing_binaries(
        cached_binaries(root, version)
    ):
        parts.append(("control plane", "kube-apiserver, etcd, kubectl"))
    if node and (
        absent(cached_node_binaries(root, version).all) or not _usable(CONTAINERD.cached(root))
    ):
        parts.append(("node", "kubelet, kube-scheduler, kube-controller-manager, containerd"))
    if tools and _tools_missing(root):
        parts.append(("tools", "kube-state-metrics, promtool, prometheus, helm, krew, actionlint"))
    if not parts:
        return None
    minutes = sum(FIRST_BUILD_MINUTES[kind] for kind, _ in parts)
    what = "; ".join(names for _, names in parts)
    return (
        f"gpuusage: first run on this machine: building {what} from Go modules, about "
        f"{minutes:g} minutes on 2 cores (fewer with more); cached in {root} afterwards"
    )


def _tools_missing(root: Path) -> bool:
    return any(not os.environ.get(tool.env) and not tool.cached(root).is_file() for tool in TOOLS)
