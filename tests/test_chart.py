"""The Helm chart, proven with helm itself (built at its pinned version).

With default values it renders what `kubectl kustomize manifests/` builds, and each documented
variant of the kustomize install has a value that renders that variant; values reach the
objects they name; wrong values are refused before anything is installed; and the chart
installs, upgrades and uninstalls on the local control plane. (Its permissions under the
agent's and the operator's own tokens are checked in test_install.py, for both install paths.)
"""

from __future__ import annotations

import json
import shutil
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage.api import names
from gpuusage_dev import chart
from gpuusage_dev.localcluster.cluster import LocalCluster
from tests.conftest import CHART, Helm, Kubectl
from tests.examples import empty_report
from tests.rendering import NS, Key, objects, one, render, set_args

REPO = Path(__file__).resolve().parents[1]


def test_the_charts_copies_are_those_of_their_sources() -> None:
    assert chart.stale(REPO) == [], "run `make chart`"
    crds = {copy.name for _, copy in chart.copies(REPO) if copy.parent.name == "crds"}
    assert crds == {
        "gpuusage.io_gpunodeusages.yaml",
        "gpuusage.io_gpuusagepolicies.yaml",
    }
    assert not (REPO / chart.CHART / "crds").exists(), "Helm never upgrades a chart's crds/"


def test_the_crds_can_be_left_to_the_user_or_deleted_on_uninstall(helm: Helm) -> None:
    """crds.enabled=false: someone else (GitOps) serves them; crds.keep=false: no keep policy."""
    crds = ("CustomResourceDefinition", "", names.CRD_NAME)
    assert crds not in render(helm, "crds.enabled=false")
    assert "annotations" not in render(helm, "crds.keep=false")[crds]["metadata"]
    # Values without crds at all (a release from before it, reused by --reuse-values) keep the
    # defaults' meaning.
    kept = render(helm, "crds=null")[crds]["metadata"]["annotations"]
    assert kept == {"helm.sh/resource-policy": "keep"}


def test_a_changed_or_orphaned_copy_is_found_and_synced(tmp_path: Path) -> None:
    versioned = (Path("src/gpuusage/__init__.py"), chart.CHART_YAML)
    for source in (*(source for source, _ in chart.copies(REPO)), *versioned):
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_bytes((REPO / source).read_bytes())
    assert len(chart.stale(tmp_path)) == len(chart.copies(REPO)), "every copy missing"
    chart.sync(tmp_path)
    assert chart.stale(tmp_path) == []
    init = tmp_path / versioned[0]
    init.write_text(init.read_text().replace("__version__ = ", '__version__ = "2.0.1"  # ', 1))
    assert chart.stale(tmp_path) == [chart.CHART_YAML]
    assert chart.sync(tmp_path) == [chart.CHART_YAML]
    written = yaml.safe_load((tmp_path / chart.CHART_YAML).read_text())
    assert (written["version"], written["appVersion"]) == ("2.0.1", "2.0.1")
    assert chart.stale(tmp_path) == []
    rules = tmp_path / "manifests" / "monitoring" / "gpuusage.rules.yaml"
    rules.write_text(rules.read_text() + "# changed\n")
    orphan = tmp_path / "charts" / "gpuusage" / "files" / "dashboards" / "gone.json"
    orphan.write_text("{}")
    stale = chart.stale(tmp_path)
    assert stale == [
        Path("charts/gpuusage/files/gpuusage.rules.yaml"),
        orphan.relative_to(tmp_path),
    ]
    assert chart.sync(tmp_path) == stale
    assert chart.stale(tmp_path) == []
    assert not orphan.exists()


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("monitoring.enabled=true",),
        ("agent.procAccess=hostProc",),
        ("openshift.enabled=true", "monitoring.enabled=true"),
        (
            "criticalPodsQuota.enabled=true",
            "agent.hostDriver.enabled=true",
            "agent.migMonitor=true",
        ),
    ],
    ids=["defaults", "monitoring", "host-proc", "openshift", "gke-mig"],
)
def test_helm_lint_finds_nothing_to_say(helm: Helm, sets: tuple[str, ...]) -> None:
    out = helm.run("lint", "--strict", str(CHART), *set_args(sets)).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    assert "[WARNING]" not in out, out


def test_the_packaged_chart_renders_the_same(helm: Helm, tmp_path: Path) -> None:
    """What a chart repository would serve: `helm package` keeps files/ (nothing the
    templates read is left out by .helmignore)."""
    out = helm.run("package", str(CHART), "-d", str(tmp_path)).stdout
    (archive,) = tmp_path.glob("gpuusage-*.tgz")
    assert str(archive) in out
    with tarfile.open(archive) as packed:
        licence = packed.extractfile("gpuusage/LICENSE")
        assert licence is not None, "the packaged chart carries the LICENSE"
        assert licence.read() == (REPO / "LICENSE").read_bytes()
    sets = ("monitoring.enabled=true",)
    assert render(helm, *sets, chart=archive) == render(helm, *sets)


@pytest.mark.parametrize(
    ("folder", "sets", "namespace"),
    [
        ("manifests", (), NS),
        ("manifests/base", ("agent.podResources.enabled=false",), NS),
        ("manifests/overlays/host-proc", ("agent.procAccess=hostProc",), NS),
        ("manifests/overlays/namespace", ("namespace.name=gpu-monitoring",), "elsewhere"),
        ("manifests/overlays/monitoring", ("monitoring.enabled=true",), NS),
        ("manifests/overlays/runtime-class", ("agent.runtimeClassName=nvidia",), NS),
        ("manifests/overlays/policy-actions", ("operator.policyActions=true",), NS),
        ("manifests/overlays/observe", ("operator.podMarks=false",), NS),
        (
            "manifests/overlays/extra-node-labels",
            (
                "agent.extraNodeSelectorTerms[0].matchExpressions[0].key=example.com/gpu",
                "agent.extraNodeSelectorTerms[0].matchExpressions[0].operator=Exists",
            ),
            NS,
        ),
        ("manifests/overlays/openshift", ("openshift.enabled=true",), NS),
        (
            "manifests/overlays/gke",
            ("criticalPodsQuota.enabled=true", "agent.hostDriver.enabled=true"),
            NS,
        ),
        ("manifests/overlays/mig-monitor", ("agent.migMonitor=true",), NS),
    ],
    ids=[
        "default",
        "base",
        "host-proc",
        "namespace",
        "monitoring",
        "runtime-class",
        "policy-actions",
        "observe",
        "extra-node-labels",
        "openshift",
        "gke",
        "mig-monitor",
    ],
)
def test_the_chart_renders_what_kustomize_builds(
    helm: Helm, kustomize: Kubectl, folder: str, sets: tuple[str, ...], namespace: str
) -> None:
    """Object for object, field for field; the Namespace only with namespace.create (Helm's
    convention is a namespace made by `--create-namespace` or beforehand)."""
    built = objects(kustomize.run("kustomize", str(REPO / folder)))
    rendered = render(helm, *sets, "namespace.create=true", namespace=namespace)
    assert sorted(rendered) == sorted(built)
    for key, obj in built.items():
        if key[0] == "CustomResourceDefinition":  # kept by `helm uninstall`, with the reports
            kept = rendered[key]["metadata"].pop("annotations")
            assert kept == {"helm.sh/resource-policy": "keep"}, key
        assert rendered[key] == obj, f"{key} differs"
    plain = render(helm, *sets, namespace=namespace)
    assert {k for k in built if k not in plain} == {k for k in built if k[0] == "Namespace"}


def _container(found: dict[Key, dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    container: dict[str, Any] = one(found, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return container


def test_values_reach_the_objects_they_name(helm: Helm) -> None:
    digest = "sha256:" + "ab" * 32
    objects = render(
        helm,
        "image.registry=registry.example:5000",
        "image.pullPolicy=Always",
        "image.pullSecrets[0].name=regcred",
        "agent.image.tag=1.2.3",
        f"operator.image.digest={digest}",
        "gpuResources={example.com/gpu,hami.io/vgpu}",
        "agent.interval=5",
        "agent.memoryThresholdMiB=128",
        "agent.extraArgs={--idle-window=120}",
        "agent.nodeSelector.gpu=yes",
        "agent.tolerations=null",
        "agent.priorityClassName=gpu-critical",
        "agent.resources.limits.memory=256Mi",
        "agent.logLevel=debug",
        "operator.replicas=3",
        "operator.idleAfter=0",
        "operator.restartGrace=30",
        "operator.staleAfter=90",
        "operator.leaderElection.leaseDuration=30",
        "operator.leaderElection.renewDeadline=20",
        "operator.leaderElection.retryPeriod=4",
        "operator.draDrivers={gpu.nvidia.com,gpu.example.com}",
        "operator.fractionAnnotations={example.com/share}",
        "operator.podDisruptionBudget.enabled=false",
        "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=control",
        "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "monitoring.enabled=true",
        "monitoring.labels.release=kube-prometheus-stack",
        "monitoring.dashboards.annotations.grafana_folder=GPU",
        "monitoring.kubeStateMetrics.enabled=false",
    )
    agent = _container(objects, "DaemonSet", "gpuusage-agent")
    assert agent["image"] == "registry.example:5000/gpuusage/gpuusage-agent:1.2.3"
    assert agent["imagePullPolicy"] == "Always"
    assert agent["args"] == [
        "agent",
        "--interval=5",
        "--memory-threshold-mib=128",
        "--gpu-resources=example.com/gpu,hami.io/vgpu",
        "--idle-window=120",
    ]
    assert {"name": "GPUUSAGE_LOG_LEVEL", "value": "debug"} in agent["env"]
    assert agent["resources"]["limits"]["memory"] == "256Mi"
    pod = one(objects, "DaemonSet", "gpuusage-agent")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "yes"}, "ANDed with the GPU node terms"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in [
        e for term in terms["nodeSelectorTerms"] for e in term["matchExpressions"]
    ]
    assert "tolerations" not in pod
    assert pod["priorityClassName"] == "gpu-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    operator = _container(objects, "Deployment", "gpuusage-operator")
    assert operator["image"] == f"registry.example:5000/gpuusage/gpuusage-operator@{digest}"
    assert operator["args"][5:] == [
        "--stale-after=90",
        "--idle-after=0",
        "--restart-grace=30",
        "--leader-elect-lease-duration=30",
        "--leader-elect-renew-deadline=20",
        "--leader-elect-retry-period=4",
        "--gpu-resources=example.com/gpu,hami.io/vgpu",
        "--dra-drivers=gpu.nvidia.com,gpu.example.com",
        "--fraction-annotations=example.com/share",
    ]
    deployment = one(objects, "Deployment", "gpuusage-operator")
    assert deployment["spec"]["replicas"] == 3
    affinity = deployment["spec"]["template"]["spec"]["affinity"]
    assert list(affinity) == ["nodeAffinity"], "a given affinity replaces the default"
    assert not [k for k in objects if k[0] == "PodDisruptionBudget"]
    for kind, name in (
        ("ServiceMonitor", "gpuusage-operator"),
        ("PodMonitor", "gpuusage-agent"),
        ("PrometheusRule", "gpuusage"),
    ):
        assert one(objects, kind, name)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboards = one(objects, "ConfigMap", "gpuusage-dashboards")
    assert dashboards["metadata"]["annotations"] == {"grafana_folder": "GPU"}
    assert sorted(dashboards["data"]) == sorted(
        p.name for p in (REPO / "manifests/monitoring/dashboards").glob("*.json")
    )
    for text in dashboards["data"].values():
        assert json.loads(text)["uid"].startswith("gpuusage")
    without_ksm = {k for k in objects if "state-metrics" in k[2]}
    assert without_ksm == set(), "kube-state-metrics and its ServiceMonitor left out"


def test_the_viewer_role_reads_the_reports_and_is_aggregated_nowhere(helm: Helm) -> None:
    """gpuusage-viewer is rendered by default (as manifests/base has it), reads every report,
    carries no aggregation label (the reports list every tenant's processes: `view`, `edit`
    and `admin` must not gain it), grants no write; viewerRole.enabled=false leaves it out,
    and values from before the value existed keep it."""
    role = one(render(helm), "ClusterRole", "gpuusage-viewer")
    labels = role["metadata"]["labels"]
    assert not [k for k in labels if k.startswith("rbac.authorization.k8s.io/aggregate-to")]
    assert "aggregationRule" not in role
    assert {
        "apiGroups": ["gpuusage.io"],
        "resources": ["gpunodeusages"],
        "verbs": ["get", "list", "watch"],
    } in role["rules"]
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs <= {"get", "list", "watch"}
    assert not [k for k in render(helm, "viewerRole.enabled=false") if k[2] == "gpuusage-viewer"]
    assert one(render(helm, "viewerRole=null"), "ClusterRole", "gpuusage-viewer") == role


def test_values_of_a_release_from_before_the_lease_still_install(helm: Helm) -> None:
    """`helm upgrade --reuse-values` of a release that set operator.peeringLifetime: the value
    is accepted and passed on, and the operator says it is ignored and what replaces it; values
    reused from before operator.leaderElection existed (null here: absent) render too."""
    objects = render(helm, "operator.peeringLifetime=30", "operator.leaderElection=null")
    assert "--peering-lifetime=30" in _container(objects, "Deployment", "gpuusage-operator")["args"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"agent": {"nodeselector": {"a": "b"}}}, "additional properties 'nodeselector'"),
        ({"agent": {"procAccess": "host"}}, "value must be one of 'hostPID', 'hostProc'"),
        ({"agent": {"image": {"tag": 1.0}}}, "at '/agent/image/tag'"),
        ({"agent": {"interval": 30}}, "agent.interval (30 s) must be at most a third"),
        ({"agent": {"leaseDuration": 5}}, "at '/agent/leaseDuration'"),
        ({"agent": {"extraArgs": ["interval=5"]}}, "at '/agent/extraArgs/0'"),
        ({"operator": {"replicas": 0}}, "at '/operator/replicas': minimum"),
        ({"operator": {"idleAfter": "30m"}}, "at '/operator/idleAfter'"),
        (
            {"operator": {"leaderElection": {"renewDeadline": 15}}},
            "operator.leaderElection: leaseDuration (15 s) > renewDeadline (15 s)",
        ),
        ({"operator": {"leaderElection": {"leaseDuration": 1}}}, "leaderElection/leaseDuration"),
        ({"gpuResources": ["nvidia"]}, "at '/gpuResources/0'"),
        ({"namespace": {"name": "Bad_NS"}}, "at '/namespace/name'"),
        ({"image": {"pullPolicy": "always"}}, "at '/image/pullPolicy'"),
        ({"monitoring": {"enabled": "yes"}}, "at '/monitoring/enabled'"),
        ({"viewerRole": {"enable": False}}, "additional properties 'enable'"),
        (
            {"agent": {"extraNodeSelectorTerms": [{"matchExpression": []}]}},
            "additional properties 'matchExpression'",
        ),
        (
            {"agent": {"extraNodeSelectorTerms": [{"matchExpressions": [{"key": "gpu"}]}]}},
            "missing property 'operator'",
        ),
        ({"agent": {"hostDriver": {"path": "home/nvidia"}}}, "at '/agent/hostDriver/path'"),
        ({"criticalPodsQuota": {"pods": 0}}, "at '/criticalPodsQuota/pods'"),
    ],
)
def test_a_wrong_value_is_refused_with_a_message_naming_it(
    helm: Helm, tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    for command in ("template", "install"):
        args = [command, "gpuusage", str(CHART), "-f", str(path)]
        if command == "install":
            args += ["--dry-run=client"]  # nothing to reach: refused before any request
        refused = helm.run(*args, check=False)
        assert refused.returncode != 0
        assert message in refused.stderr, refused.stderr


# -- on the control plane ---------------------------------------------------------------------


@pytest.fixture
def cluster_helm(helm_binary: Path, cluster: LocalCluster, tmp_path: Path) -> Helm:
    return Helm(helm_binary, tmp_path / "helm", cluster.kubeconfig)


@pytest.fixture
def release(cluster_helm: Helm) -> Iterator[tuple[str, str]]:
    name, namespace = "gpuusage", f"gpuusage-{uuid.uuid4().hex[:5]}"
    yield name, namespace
    cluster_helm.run("uninstall", name, "-n", namespace, check=False)


def _status(helm: Helm, name: str, namespace: str) -> dict[str, Any]:
    out = helm.run("status", name, "-n", namespace, "-o", "json").stdout
    status: dict[str, Any] = json.loads(out)
    return status


def _get(kubectl: Kubectl, *what: str) -> dict[str, Any] | None:
    """The object as JSON, or None when the apiserver has none."""
    proc = kubectl.run("get", *what, "-o", "json", "--ignore-not-found", check=False)
    text = proc.strip()
    if not text:
        return None
    got: dict[str, Any] = json.loads(text)
    return got


@pytest.mark.cluster
@pytest.mark.usefixtures("monitoring_kinds")
def test_install_upgrade_and_uninstall_on_the_control_plane(
    cluster_helm: Helm, kubectl: Kubectl, release: tuple[str, str], tmp_path: Path
) -> None:
    name, namespace = release
    ns = ("-n", namespace)
    # An earlier install (kustomize's, in test_install) may hold the cluster-scoped names.
    take = ("--take-ownership", "--force-conflicts")
    cluster_helm.run(
        "install", name, str(CHART), *ns, "--create-namespace", *take,
        "--set", "monitoring.enabled=true",
    )  # fmt: skip
    assert _status(cluster_helm, name, namespace)["info"]["status"] == "deployed"
    rendered = render(cluster_helm, "monitoring.enabled=true", namespace=namespace)
    assert len(rendered) == 37  # the monitoring overlay's 38 but the Namespace
    for kind, obj_ns, obj_name in rendered:
        if kind == "Namespace":
            continue  # made by --create-namespace, not the release
        where = ("-n", obj_ns) if obj_ns else ()
        found = _get(kubectl, kind, obj_name, *where)
        assert found is not None, (kind, obj_name)
        assert found["metadata"]["annotations"]["meta.helm.sh/release-name"] == name
    binding = _get(kubectl, "clusterrolebinding", "gpuusage-operator")
    assert binding is not None
    assert [(s["name"], s["namespace"]) for s in binding["subjects"]] == [
        ("gpuusage-operator", namespace)
    ]

    # Upgrade to a chart whose CRD has a new field, with changed values: the CRD and the
    # objects follow, what is switched off goes.
    newer = tmp_path / "gpuusage"
    shutil.copytree(CHART, newer)
    crd_file = newer / "files" / "crds" / "gpuusage.io_gpunodeusages.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"]["upgradeProbe"] = {"type": "string"}
    crd_file.write_text(yaml.safe_dump(crd))
    # --force-conflicts: the session made the CRDs with another client, which still co-owns
    # the fields the install applied unchanged (docs/install.md, moving to Helm).
    cluster_helm.run(
        "upgrade", name, str(newer), *ns, "--reset-then-reuse-values", "--force-conflicts",
        "--set", "operator.idleAfter=600", "--set", "monitoring.dashboards.enabled=false",
    )  # fmt: skip
    status = _status(cluster_helm, name, namespace)
    assert (status["version"], status["info"]["status"]) == (2, "deployed")
    served = _get(kubectl, "crd", names.CRD_NAME)
    assert served is not None
    properties = served["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    assert "upgradeProbe" in properties["spec"]["properties"], "helm upgrade upgrades the CRDs"
    deployment = _get(kubectl, "deployment", "gpuusage-operator", *ns)
    assert deployment is not None
    assert "--idle-after=600" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _get(kubectl, "configmap", "gpuusage-dashboards", *ns) is None
    assert _get(kubectl, "configmap", "gpuusage-state-metrics-config", *ns) is not None

    # A report exists; uninstalling removes the release's objects, never the CRDs (their
    # resource policy is "keep"), so the reports stay.
    node = f"helm-{uuid.uuid4().hex[:5]}"
    report = empty_report(node)
    kubectl.run("create", "-f", "-", stdin=json.dumps(report))
    try:
        cluster_helm.run("uninstall", name, *ns)
        for what in (
            ("daemonset", "gpuusage-agent", *ns),
            ("deployment", "gpuusage-operator", *ns),
            ("prometheusrule", "gpuusage", *ns),
            ("clusterrole", "gpuusage-agent"),
            ("validatingadmissionpolicy", "gpuusage-agent-own-node"),
        ):
            assert _get(kubectl, *what) is None, what
        assert _get(kubectl, "crd", names.CRD_NAME) is not None
        assert _get(kubectl, names.PLURAL, node) is not None
    finally:
        kubectl.run("delete", names.PLURAL, node, "--ignore-not-found")
        # The session's CRD as it was: no test field, no owner that is gone.
        kubectl.run("replace", "-f", str(REPO / "crds" / "gpuusage.io_gpunodeusages.yaml"))


def test_the_pod_resources_socket_of_a_kubelet_with_another_root_dir(helm: Helm) -> None:
    """k0s and MicroK8s run the kubelet with another --root-dir: the socket's folder is taken
    from there and mounted where the agent looks for it."""
    for root in ("/var/lib/k0s/kubelet", "/var/snap/microk8s/common/var/lib/kubelet"):
        objects = render(helm, f"agent.podResources.hostPath={root}/pod-resources")
        pod = one(objects, "DaemonSet", "gpuusage-agent")["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "pod-resources")
        assert volume["hostPath"]["path"] == f"{root}/pod-resources"
        mount = next(
            m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "pod-resources"
        )
        assert mount["mountPath"] == "/var/lib/kubelet/pod-resources"


def test_the_cdi_spec_folders_are_mounted_where_the_agent_reads_them(helm: Helm) -> None:
    """The default folders are mounted read-only at their own paths (the agent's default, no
    flag); other folders are mounted and named to the agent; none: neither."""

    def agent(*sets: str) -> tuple[list[Any], list[Any], list[str]]:
        pod = one(render(helm, *sets), "DaemonSet", "gpuusage-agent")["spec"]["template"]
        spec = pod["spec"]
        mounts = [
            (m["mountPath"], m["readOnly"])
            for m in spec["containers"][0]["volumeMounts"]
            if m["name"].startswith("cdi-specs-")
        ]
        volumes = [v["hostPath"] for v in spec["volumes"] if v["name"].startswith("cdi-specs-")]
        flags = [a for a in spec["containers"][0]["args"] if a.startswith("--cdi-spec-dirs")]
        return mounts, volumes, flags

    assert agent() == (
        [("/etc/cdi", True), ("/var/run/cdi", True)],
        [
            {"path": "/etc/cdi", "type": "DirectoryOrCreate"},
            {"path": "/var/run/cdi", "type": "DirectoryOrCreate"},
        ],
        [],
    )
    assert agent("agent.podResources.cdiSpecDirs={/run/cdi}") == (
        [("/run/cdi", True)],
        [{"path": "/run/cdi", "type": "DirectoryOrCreate"}],
        ["--cdi-spec-dirs=/run/cdi"],
    )
    assert agent("agent.podResources.cdiSpecDirs=null") == ([], [], ["--cdi-spec-dirs="])
    assert agent("agent.podResources.enabled=false") == ([], [], [])


def test_host_network_and_extra_volumes_reach_the_pods(helm: Helm) -> None:
    """Where pods on GPU nodes cannot reach the apiserver's Service, both run on the node's
    network; the agent takes more volumes and mounts (a CA bundle, a GPU scenario)."""
    objects = render(
        helm,
        "agent.hostNetwork=true",
        "operator.hostNetwork=true",
        "agent.extraVolumes[0].name=ca",
        "agent.extraVolumes[0].configMap.name=corp-ca",
        "agent.extraVolumeMounts[0].name=ca",
        "agent.extraVolumeMounts[0].mountPath=/etc/ca",
    )
    for kind, name in (("DaemonSet", "gpuusage-agent"), ("Deployment", "gpuusage-operator")):
        pod = one(objects, kind, name)["spec"]["template"]["spec"]
        assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    agent = one(objects, "DaemonSet", "gpuusage-agent")["spec"]["template"]["spec"]
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in agent["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ca"} in agent["containers"][0]["volumeMounts"]
    plain = one(render(helm), "DaemonSet", "gpuusage-agent")["spec"]["template"]["spec"]
    assert "hostNetwork" not in plain


def test_observe_first_and_the_namespace_selector_reach_the_operator(helm: Helm) -> None:
    args = _container(
        render(helm, "operator.podMarks=false", r"operator.namespaceSelector=team in (a\,b)"),
        "Deployment",
        "gpuusage-operator",
    )["args"]
    assert "--no-pod-marks" in args
    assert "--namespace-selector=team in (a,b)" in args
    default = _container(render(helm), "Deployment", "gpuusage-operator")["args"]
    assert not [a for a in default if "pod-marks" in a or "namespace-selector" in a]


def test_observing_first_with_policy_actions_grants_only_the_node_rules_rights(
    helm: Helm,
) -> None:
    rendered = render(helm, "operator.podMarks=false", "operator.policyActions=true")
    rules = one(rendered, "ClusterRole", "gpuusage-operator-policy-actions")["rules"]
    assert {r for rule in rules for r in rule["resources"]} == {"nodes", "nodes/status"}
    marking = render(helm, "operator.policyActions=true")
    pods = one(marking, "ClusterRole", "gpuusage-operator-policy-actions")["rules"][0]
    assert pods["resources"] == ["pods"]


def _notes(helm: Helm, *sets: str) -> str:
    """The NOTES helm prints after an install with these values (a client-side dry run)."""
    out = helm.run(
        "install", "gpuusage", str(CHART), "-n", NS, "--dry-run=client", *set_args(sets)
    ).stdout
    assert "\nNOTES:\n" in out, out[-2000:]
    return out.split("\nNOTES:\n", 1)[1]


def test_the_notes_say_where_the_agent_runs_and_where_to_look_in_either_mode(helm: Helm) -> None:
    """The NOTES name the node terms that choose the agent's nodes (not the empty nodeSelector)
    and point at pods' marks only where the operator writes them."""
    marking = _notes(helm)
    terms = yaml.safe_load((CHART / "values.yaml").read_text())["agent"]["gpuNodeSelectorTerms"]
    for term in terms:
        (expression,) = term["matchExpressions"]
        label = expression["key"] + (
            "=" + expression["values"][0] if expression["operator"] == "In" else ""
        )
        assert f"\n  {label}\n" in marking
    assert "matching {}" not in marking
    assert "gpuusage.io/GPUInUse" in marking
    assert "Observe only" not in marking

    observing = _notes(helm, "operator.podMarks=false")
    assert "kubectl describe pod" not in observing
    assert "Observe only (operator.podMarks=false): no pod carries" in observing
    for where in ("kubectl get gpunodeusage", "kubectl gpuusage top -A", "kubectl get reports -A"):
        assert where in observing
    assert "--set operator.podMarks=true" in observing
    assert "operator.unmarkPods=true" not in observing
    unmarking = _notes(helm, "operator.podMarks=false", "operator.unmarkPods=true")
    assert "operator.unmarkPods=true: the operator takes off the marks" in unmarking
    assert "kubectl get reports" not in _notes(helm, "operator.openReports=false")

    every = _notes(helm, "agent.gpuNodeSelectorTerms=null")
    assert "The agent runs on every node" in every
    extra = _notes(
        helm,
        "agent.extraNodeSelectorTerms[0].matchExpressions[0].key=example.com/gpu",
        "agent.extraNodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    )
    assert "\n  example.com/gpu\n" in extra
    assert "\n  nvidia.com/gpu.present=true\n" in extra
    scoped = _notes(helm, "operator.namespaceSelector=team=a")
    assert "match operator.namespaceSelector\n(team=a)" in scoped
