"""The platform variants of the install, each rendered by the real helm and kubectl kustomize
(tests/test_chart.py holds the two to the same objects) and proven where something real can
judge it without the platform itself.

- Node selection: the real DaemonSet controller, on an apiserver of its own, starts an agent on
  exactly the nodes one of the GPU labellers marked (GPU feature discovery, node feature
  discovery in its two label forms, GKE, Cluster Autoscaler on AWS, AKS) or that an added term
  names, and on no other.
- GKE: that apiserver admits system-node-critical pods only where a ResourceQuota for the class
  is, as GKE's does (the ResourceQuota admission's limitedResources): a pod of the agent's
  template is refused without the chart's quota and admitted with it. The managed driver's
  variant mounts the node's driver folder and runs privileged.
- OpenShift: the SCC CRD of openshift/api is served, and the SCC, its Role and the pods are
  applied with strict field validation; OpenShift's own SCC matching (tools scc-check) admits
  the agent's pod under its SCC and the operator's and kube-state-metrics' under restricted-v2,
  and refuses what each must not admit.
- MIG: the NVIDIA runtime's own hook grants the monitor variant the MIG monitor capability,
  and refuses the variable in a container without the CAP_SYS_ADMIN the variant adds.
- NVML from a host driver's folder: pynvml loads the library LD_LIBRARY_PATH names.
"""

from __future__ import annotations

import _json as json_module
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.binaries import ensure_node_binaries
from gpuusage_dev.localcluster.cluster import LocalCluster, die_with_parent
from gpuusage_dev.localcluster.tools import (
    NVIDIA_RUNTIME_HOOK,
    OPENSHIFT_SCC_CRDS,
    crds,
    ensure_tool,
)
from gpuusage_dev.scccheck import Admission, admit, ensure_scc_check
from gpuusage_dev.simulation import ensure_namespace
from tests.conftest import Helm, Kubectl, wait_for
from tests.rendering import NS, Key, one, render

REPO = Path(__file__).resolve().parents[1]
RESTRICTED_V2 = REPO / "tests" / "data" / "openshift-restricted-v2.yaml"

LABELLED = {
    "gfd": {"nvidia.com/gpu.present": "true"},
    "nfd-vendor": {"feature.node.kubernetes.io/pci-10de.present": "true"},
    "nfd-3d-controller": {"feature.node.kubernetes.io/pci-0302_10de.present": "true"},
    "nfd-vga": {"feature.node.kubernetes.io/pci-0300_10de.present": "true"},
    "gke": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
    "eks": {"k8s.amazonaws.com/accelerator": "nvidia-tesla-t4"},
    "aks": {"kubernetes.azure.com/accelerator": "nvidia"},
}
"""A node as each GPU labeller leaves it (the labels' values as each documents them)."""
OTHERS = {
    "cpu": {"kubernetes.io/os": "linux"},
    "gfd-no-gpu": {"nvidia.com/gpu.present": "false"},
    "nfd-other-vendor": {"feature.node.kubernetes.io/pci-0302_1002.present": "true"},
    "own-label": {"example.com/gpu": "yes"},
}
"""Nodes no default term selects; the last one an added term does."""
EXTRA_TERM = (
    "agent.extraNodeSelectorTerms[0].matchExpressions[0].key=example.com/gpu",
    "agent.extraNodeSelectorTerms[0].matchExpressions[0].operator=Exists",
)


def _pod_template(objects: dict[Key, dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    template: dict[str, Any] = one(objects, kind, name)["spec"]["template"]
    return template


def _as_pod(template: dict[str, Any], namespace: str = NS) -> dict[str, Any]:
    """A pod of a workload's template, as its controller would create it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "probe", "namespace": namespace},
        "spec": template["spec"],
    }


# -- rendered ---------------------------------------------------------------------------------


def test_extra_terms_are_ored_and_other_affinity_is_kept(helm: Helm) -> None:
    """Added terms join the GPU terms; nodeSelector and the rest of agent.affinity stay beside
    them; no terms at all leave the agent unconstrained but for nodeSelector."""
    preferred = "agent.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution"
    objects = render(
        helm,
        *EXTRA_TERM,
        f"{preferred}[0].weight=10",
        f"{preferred}[0].preference.matchExpressions[0].key=fast",
        f"{preferred}[0].preference.matchExpressions[0].operator=Exists",
    )
    pod = _pod_template(objects, "DaemonSet", "gpuusage-agent")["spec"]
    node_affinity = pod["affinity"]["nodeAffinity"]
    terms = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == len(LABELLED) + 1
    assert terms[-1] == {"matchExpressions": [{"key": "example.com/gpu", "operator": "Exists"}]}
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10
    assert "nodeSelector" not in pod

    bare = render(helm, "agent.gpuNodeSelectorTerms=null", "agent.nodeSelector.gpu=yes")
    pod = _pod_template(bare, "DaemonSet", "gpuusage-agent")["spec"]
    assert "affinity" not in pod
    assert pod["nodeSelector"] == {"gpu": "yes"}
    # Values written when GFD's label was the default selector removed it with a null.
    old = render(
        helm, r"agent.nodeSelector.nvidia\.com/gpu\.present=null", "agent.nodeSelector.gpu=yes"
    )
    assert _pod_template(old, "DaemonSet", "gpuusage-agent")["spec"]["nodeSelector"] == {
        "gpu": "yes"
    }


def test_a_required_node_affinity_of_ones_own_is_refused_with_the_values_to_use(
    helm: Helm,
) -> None:
    required = "agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    refused = helm.run(
        "template", "gpuusage", str(REPO / "charts" / "gpuusage"),
        "--set", f"{required}.nodeSelectorTerms[0].matchExpressions[0].key=gpu",
        "--set", f"{required}.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "add your terms there" in refused.stderr
    assert "agent.extraNodeSelectorTerms" in refused.stderr


def test_the_gke_managed_driver_variant_loads_nvml_from_the_nodes_driver(helm: Helm) -> None:
    """The node's driver folder read-only at /usr/local/nvidia, libnvidia-ml.so.1 found through
    LD_LIBRARY_PATH, the container privileged (no NVIDIA runtime hands it the device nodes),
    and the quota for system-node-critical; another folder where the driver is elsewhere."""
    objects = render(
        helm,
        "agent.hostDriver.enabled=true",
        "agent.hostDriver.path=/opt/nvidia",
        "criticalPodsQuota.enabled=true",
    )
    spec = _pod_template(objects, "DaemonSet", "gpuusage-agent")["spec"]
    container = spec["containers"][0]
    assert {"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"} in container["env"]
    assert {
        "name": "nvidia-driver",
        "mountPath": "/usr/local/nvidia",
        "readOnly": True,
    } in container["volumeMounts"]
    assert {
        "name": "nvidia-driver",
        "hostPath": {"path": "/opt/nvidia", "type": "Directory"},
    } in spec["volumes"]
    assert container["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    quota = one(objects, "ResourceQuota", "gpuusage-critical-pods")["spec"]
    assert quota["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical"]}
    ]
    both = render(
        helm, "criticalPodsQuota.enabled=true", "operator.priorityClassName=system-cluster-critical"
    )
    expressions = one(both, "ResourceQuota", "gpuusage-critical-pods")["spec"]["scopeSelector"]
    assert expressions["matchExpressions"][0]["values"] == [
        "system-node-critical",
        "system-cluster-critical",
    ]
    refused = helm.run(
        "template", "gpuusage", str(REPO / "charts" / "gpuusage"),
        "--set", "criticalPodsQuota.enabled=true", "--set", "agent.priorityClassName=",
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "no priority class for the quota to admit" in refused.stderr


LOADED = """
import pathlib, pynvml
try:
    pynvml.nvmlInit()
    said = "initialised"
except pynvml.NVMLError as exc:
    said = type(exc).__name__
maps = pathlib.Path("/proc/self/maps").read_text()
print(said, [line.split()[-1] for line in maps.splitlines() if "libnvidia-ml" in line][:1])
"""


def test_nvml_is_read_from_the_folder_the_host_driver_variant_puts_on_ld_library_path(
    tmp_path: Path,
) -> None:
    """pynvml opens libnvidia-ml.so.1 by name, so the dynamic loader looks in LD_LIBRARY_PATH
    before the system's folders: the library the variant mounts at /usr/local/nvidia/lib64 is
    the one loaded. Here a stand-in of that name without NVML's functions (a Python extension
    module) is found there and loaded, whatever the machine has installed."""
    lib64 = tmp_path / "nvidia" / "lib64"
    lib64.mkdir(parents=True)
    stand_in = lib64 / "libnvidia-ml.so.1"
    stand_in.write_bytes(Path(json_module.__file__ or "").read_bytes())
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib64)}
    out = subprocess.run(
        [sys.executable, "-c", LOADED], env=env, capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    assert out == ["NVMLError_FunctionNotFound", f"['{stand_in}']\n"], out


def test_the_mig_monitor_variant_asks_the_runtime_for_the_capability_it_requires(
    helm: Helm,
) -> None:
    """NVIDIA_MIG_MONITOR_DEVICES=all, and CAP_SYS_ADMIN in the container's set, without which
    the NVIDIA runtime's hook refuses to start the container ("cannot set MIG_MONITOR_DEVICES
    in non privileged container"); nothing of it by default."""
    agent = _pod_template(render(helm, "agent.migMonitor=true"), "DaemonSet", "gpuusage-agent")
    container = agent["spec"]["containers"][0]
    assert {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"} in container["env"]
    assert container["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["SYS_ADMIN"],
    }
    plain = _pod_template(render(helm), "DaemonSet", "gpuusage-agent")["spec"]["containers"][0]
    assert not [e for e in plain["env"] if e["name"] == "NVIDIA_MIG_MONITOR_DEVICES"]
    assert plain["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def _bounding_set(security_context: dict[str, Any]) -> list[str]:
    """The capabilities containerd and CRI-O give a non-privileged container: the runtime's
    defaults, all of them dropped on "ALL", then each one added, named CAP_<name> in the spec."""
    capabilities = security_context.get("capabilities", {})
    assert capabilities.get("drop") == ["ALL"], "every variant here drops all first"
    return [f"CAP_{name}" for name in capabilities.get("add", [])]


def _hook(hook: Path, tmp_path: Path, container: dict[str, Any]) -> tuple[int, str, str]:
    """The NVIDIA runtime's hook (legacy mode) on the OCI spec of the agent's container: its
    exit status, what it said, and the nvidia-container-cli command it ran (a stand-in that
    records its arguments)."""
    bundle, config = tmp_path / "bundle", tmp_path / "config" / "nvidia-container-runtime"
    (bundle / "rootfs").mkdir(parents=True)
    config.mkdir(parents=True)
    recorded = tmp_path / "cli-args"
    cli = tmp_path / "nvidia-container-cli"
    cli.write_text(f'#!/bin/sh\necho "$@" > {recorded}\n')
    cli.chmod(0o755)
    (config / "config.toml").write_text(
        f'[nvidia-container-cli]\npath = "{cli}"\n[nvidia-container-runtime]\nmode = "legacy"\n'
    )
    bounding = _bounding_set(container["securityContext"])
    spec = {
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs"},
        "process": {
            "args": container["args"],
            "cwd": "/",
            "env": [f"{e['name']}={e['value']}" for e in container["env"] if "value" in e],
            "capabilities": {"bounding": bounding, "effective": bounding, "permitted": bounding},
        },
        "mounts": [],
    }
    (bundle / "config.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(hook), "prestart"],
        input=json.dumps({"bundle": str(bundle)}),
        env={**os.environ, "XDG_CONFIG_HOME": str(config.parent)},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    called = recorded.read_text() if recorded.exists() else ""
    return proc.returncode, proc.stderr, called


@pytest.mark.slow
def test_the_nvidia_runtime_grants_the_mig_monitor_only_with_cap_sys_admin(
    helm: Helm, tmp_path: Path
) -> None:
    """The NVIDIA container runtime's own hook (nvidia-container-toolkit, legacy mode), on the
    agent's container: the MIG variant gets nvidia-container-cli's --mig-monitor=all; the same
    variable without CAP_SYS_ADMIN is refused outright, so the container would not start, on any
    node; the default agent starts without the monitor capability. Why the variable is not set
    by default (docs/setups.md)."""
    hook = ensure_tool(NVIDIA_RUNTIME_HOOK)
    mig = _pod_template(render(helm, "agent.migMonitor=true"), "DaemonSet", "gpuusage-agent")
    container = mig["spec"]["containers"][0]
    status, said, called = _hook(hook, tmp_path / "mig", container)
    assert status == 0, said
    assert "--mig-monitor=all" in called.split()
    assert "--utility" in called.split()

    without = {**container, "securityContext": {"capabilities": {"drop": ["ALL"]}}}
    status, said, called = _hook(hook, tmp_path / "without", without)
    assert status != 0
    assert "cannot set MIG_MONITOR_DEVICES in non privileged container" in said
    assert called == "", "nvidia-container-cli never ran"

    plain = _pod_template(render(helm), "DaemonSet", "gpuusage-agent")["spec"]["containers"][0]
    status, said, called = _hook(hook, tmp_path / "plain", plain)
    assert status == 0, said
    assert "--device=all" in called.split()
    assert not [a for a in called.split() if a.startswith("--mig-monitor")]


# -- OpenShift's own SCC matching ---------------------------------------------------------------


@pytest.fixture(scope="module")
def scc_check() -> Path:
    return ensure_scc_check()


def _restricted_v2() -> dict[str, Any]:
    scc: dict[str, Any] = yaml.safe_load(RESTRICTED_V2.read_text())
    return scc


def _admitted(admission: Admission) -> dict[str, Any]:
    assert admission.errors == [], admission.errors
    return admission.pod


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sets", "uid"),
    [
        ((), 0),
        (("agent.podResources.enabled=false",), 65532),
        (("agent.procAccess=hostProc",), 0),
        (("agent.migMonitor=true",), 0),
    ],
    ids=["default", "no-pod-resources", "host-proc", "mig-monitor"],
)
def test_openshift_admits_the_agent_under_its_scc_with_selinux_type_spc_t(
    helm: Helm, scc_check: Path, sets: tuple[str, ...], uid: int
) -> None:
    objects = render(helm, "openshift.enabled=true", *sets)
    scc = one(objects, "SecurityContextConstraints", "gpuusage-agent")
    template = _pod_template(objects, "DaemonSet", "gpuusage-agent")
    assert (
        template["metadata"]["annotations"]["openshift.io/required-scc"] == scc["metadata"]["name"]
    )
    pod = _admitted(admit(scc_check, scc, _as_pod(template)))
    assert pod["spec"]["securityContext"]["seLinuxOptions"] == {"type": "spc_t", "level": "s0"}
    assert pod["spec"]["securityContext"]["runAsUser"] == uid
    assert pod["spec"].get("hostPID", False) is (sets != ("agent.procAccess=hostProc",))


@pytest.mark.slow
def test_openshift_refuses_what_the_agents_scc_does_not_grant(helm: Helm, scc_check: Path) -> None:
    """The SCC grants the agent's own pod and no more: the default SCC refuses the MIG monitor
    variant's CAP_SYS_ADMIN and a privileged container; restricted-v2 refuses the agent."""
    scc = one(
        render(helm, "openshift.enabled=true"), "SecurityContextConstraints", "gpuusage-agent"
    )
    mig = _pod_template(render(helm, "agent.migMonitor=true"), "DaemonSet", "gpuusage-agent")
    refused = admit(scc_check, scc, _as_pod(mig))
    assert any("SYS_ADMIN" in e for e in refused.errors), refused.errors
    gke = _pod_template(
        render(helm, "agent.hostDriver.enabled=true"), "DaemonSet", "gpuusage-agent"
    )
    refused = admit(scc_check, scc, _as_pod(gke))
    assert any("privileged" in e.lower() for e in refused.errors), refused.errors
    agent = _pod_template(render(helm, "openshift.enabled=true"), "DaemonSet", "gpuusage-agent")
    refused = admit(scc_check, _restricted_v2(), _as_pod(agent))
    assert any("hostPID" in e for e in refused.errors), refused.errors


@pytest.mark.slow
def test_openshift_admits_the_operator_and_state_metrics_under_restricted_v2(
    helm: Helm, scc_check: Path
) -> None:
    """Without a fixed user restricted-v2 gives each pod one from the namespace's range; the
    default install's fixed 65532 (and kube-state-metrics' 65534) it refuses."""
    sets = ("monitoring.enabled=true",)
    for name in ("gpuusage-operator", "gpuusage-state-metrics"):
        template = _pod_template(render(helm, "openshift.enabled=true", *sets), "Deployment", name)
        assert template["metadata"]["annotations"]["openshift.io/required-scc"] == "restricted-v2"
        pod = _admitted(admit(scc_check, _restricted_v2(), _as_pod(template)))
        uids = {c["securityContext"]["runAsUser"] for c in pod["spec"]["containers"]}
        assert uids == {1000680000}, name
        fixed = _pod_template(render(helm, *sets), "Deployment", name)
        refused = admit(scc_check, _restricted_v2(), _as_pod(fixed))
        assert any("must be in the ranges" in e for e in refused.errors), refused.errors


def test_openshift_refuses_an_operator_on_the_nodes_network(helm: Helm) -> None:
    refused = helm.run(
        "template", "gpuusage", str(REPO / "charts" / "gpuusage"),
        "--set", "openshift.enabled=true", "--set", "operator.hostNetwork=true",
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "restricted-v2, which refuses the node's network" in refused.stderr


# -- on the apiserver ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scc_served(cluster: LocalCluster) -> None:
    """OpenShift's SCC CRD, from openshift/api's Go module, served by the session's apiserver."""
    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    (crd,) = crds(OPENSHIFT_SCC_CRDS)
    kubectl.run("apply", "--server-side", "-f", str(crd))
    kubectl.run(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/securitycontextconstraints.security.openshift.io",
    )  # fmt: skip


@pytest.mark.cluster
@pytest.mark.usefixtures("scc_served")
@pytest.mark.parametrize("overlay", ["openshift", "gke", "mig-monitor", "extra-node-labels"])
def test_every_platform_overlay_validates_server_side(
    kubectl: Kubectl, api: client.ApiClient, overlay: str
) -> None:
    """Each overlay's objects, the SCC against OpenShift's schema, are accepted with strict
    field validation (an unknown or misspelt field is refused)."""
    ensure_namespace(client.CoreV1Api(api), NS)
    out = kubectl.run(
        "apply", "-k", str(REPO / "manifests" / "overlays" / overlay),
        "--dry-run=server", "--validate=strict",
    )  # fmt: skip
    assert "daemonset.apps/gpuusage-agent" in out
    if overlay == "openshift":
        assert "securitycontextconstraints.security.openshift.io/gpuusage-agent" in out


@pytest.mark.cluster
@pytest.mark.usefixtures("scc_served")
def test_the_sccs_meet_openshifts_schema_and_a_wrong_field_is_refused(
    kubectl: Kubectl, helm: Helm, tmp_path: Path
) -> None:
    """The chart's SCC in each variant, and the record of restricted-v2 the tests judge the
    operator by, against the served schema; a misspelt field shows the check can fail."""
    for sets in ((), ("agent.migMonitor=true", "agent.hostNetwork=true")):
        scc = one(
            render(helm, "openshift.enabled=true", *sets),
            "SecurityContextConstraints",
            "gpuusage-agent",
        )
        path = tmp_path / "scc.json"
        path.write_text(json.dumps(scc))
        kubectl.run("apply", "-f", str(path), "--dry-run=server", "--validate=strict")
    # create, not apply: kubectl's apply drops the nulls OpenShift's record has and the schema
    # requires (defaultAddCapabilities, priority)
    kubectl.run("create", "-f", str(RESTRICTED_V2), "--dry-run=server", "--validate=strict")
    wrong = {**scc, "allowHostPid": True}
    path.write_text(json.dumps(wrong))
    refused = kubectl.run(
        "apply", "-f", str(path), "--dry-run=server", "--validate=strict", check=False
    )
    assert 'unknown field "allowHostPid"' in refused, refused


# -- the DaemonSet controller and GKE's quota rule, on an apiserver of their own -----------------


@pytest.fixture(scope="module")
def gke_like(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """An apiserver that admits pods of system-node-critical and system-cluster-critical only in
    namespaces holding a ResourceQuota for their class (the ResourceQuota admission's
    limitedResources, GKE's rule), with the DaemonSet and ResourceQuota controllers of the same
    Kubernetes release."""
    directory = tmp_path_factory.mktemp("gke-like")
    config = directory / "admission.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "apiserver.config.k8s.io/v1",
                "kind": "AdmissionConfiguration",
                "plugins": [
                    {
                        "name": "ResourceQuota",
                        "configuration": {
                            "apiVersion": "apiserver.config.k8s.io/v1",
                            "kind": "ResourceQuotaConfiguration",
                            "limitedResources": [
                                {
                                    "resource": "pods",
                                    "matchScopes": [
                                        {
                                            "scopeName": "PriorityClass",
                                            "operator": "In",
                                            "values": [
                                                "system-node-critical",
                                                "system-cluster-critical",
                                            ],
                                        }
                                    ],
                                }
                            ],
                        },
                    }
                ],
            }
        )
    )
    local = LocalCluster(
        directory / "cluster",
        tie_to_parent=True,
        apiserver_args=[f"--admission-control-config-file={config}"],
    )
    local.up()
    controllers: subprocess.Popen[bytes] | None = None
    try:
        binary = ensure_node_binaries(version=local.kubernetes_version).kube_controller_manager
        with (directory / "kube-controller-manager.log").open("wb") as log:
            controllers = subprocess.Popen(
                [
                    str(binary),
                    f"--kubeconfig={local.kubeconfig}",
                    "--leader-elect=false",
                    "--secure-port=0",
                    "--controllers=daemonset,resourcequota",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
        yield local
    finally:
        if controllers is not None:
            controllers.terminate()
            controllers.wait(timeout=20)
        local.down()


def _apply(kubectl: Kubectl, *objects: dict[str, Any]) -> str:
    return kubectl.run(
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
    )


def _get(kubectl: Kubectl, *what: str) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(kubectl.run("get", *what, "-o", "json"))
    return got


def _target_node(pod: dict[str, Any]) -> str:
    """The node the DaemonSet controller made the pod for: the one field term of the node
    affinity it gives each daemon pod (the scheduler binds it there)."""
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (field,) = term["matchFields"]
    assert field["key"] == "metadata.name"
    (node,) = field["values"]
    return str(node)


@pytest.mark.cluster
def test_the_daemonset_controller_runs_an_agent_on_each_labelled_node_and_no_other(
    gke_like: LocalCluster, helm: Helm
) -> None:
    """Nodes as each GPU labeller marks them, nodes it does not, and one with a label of one's
    own: the real DaemonSet controller creates an agent pod for exactly the labelled nodes and
    the added term's; the chart's quota lets GKE's rule admit them (system-node-critical)."""
    kubectl = Kubectl(gke_like.binaries.kubectl, gke_like.kubeconfig)
    suffix = uuid.uuid4().hex[:5]
    api, _ = api_client(gke_like.kubeconfig)
    with api:
        core = client.CoreV1Api(api)
        for name, labels in {**LABELLED, **OTHERS}.items():
            meta = client.V1ObjectMeta(name=f"{name}-{suffix}", labels=labels)
            core.create_node(client.V1Node(metadata=meta))
            # Ready, as its kubelet would report it: the not-ready taint the apiserver puts on
            # a new node, which no daemon pod tolerates, off.
            core.patch_node(f"{name}-{suffix}", {"spec": {"taints": None}})
        ensure_namespace(core, NS)
    objects = render(helm, "criticalPodsQuota.enabled=true", *EXTRA_TERM)
    _apply(
        kubectl,
        one(objects, "ServiceAccount", "gpuusage-agent"),
        one(objects, "ResourceQuota", "gpuusage-critical-pods"),
        one(objects, "DaemonSet", "gpuusage-agent"),
    )
    expected = {f"{n}-{suffix}" for n in (*LABELLED, "own-label")}

    def agents_on() -> set[str] | None:
        pods = _get(kubectl, "pods", "-n", NS, "-l", "app.kubernetes.io/name=gpuusage-agent")
        nodes = {_target_node(p) for p in pods["items"]}
        return nodes if nodes == expected else None

    wait_for(agents_on, timeout=60, what="an agent pod on each labelled node and no other")
    status = _get(kubectl, "daemonset", "gpuusage-agent", "-n", NS)["status"]
    assert status["desiredNumberScheduled"] == len(expected)
    counted = {"pods": str(len(expected))}
    wait_for(
        lambda: (
            _get(kubectl, "resourcequota", "gpuusage-critical-pods", "-n", NS)["status"]["used"]
            == counted
        ),
        what="the quota counting the agents",
    )


@pytest.mark.cluster
def test_gke_refuses_the_agents_priority_class_without_the_quota_and_admits_it_with(
    gke_like: LocalCluster, helm: Helm
) -> None:
    namespace = f"no-quota-{uuid.uuid4().hex[:5]}"
    kubectl = Kubectl(gke_like.binaries.kubectl, gke_like.kubeconfig)
    api, _ = api_client(gke_like.kubeconfig)
    with api:
        ensure_namespace(client.CoreV1Api(api), namespace)
    objects = render(helm, "criticalPodsQuota.enabled=true", namespace=namespace)
    _apply(kubectl, one(objects, "ServiceAccount", "gpuusage-agent"))
    pod = json.dumps(_as_pod(_pod_template(objects, "DaemonSet", "gpuusage-agent"), namespace))
    refused = kubectl.run("create", "-f", "-", stdin=pod, check=False)
    assert "insufficient quota to match these scopes" in refused, refused
    assert "system-node-critical" in refused
    _apply(kubectl, one(objects, "ResourceQuota", "gpuusage-critical-pods"))
    kubectl.run("create", "-f", "-", stdin=pod)
    created = _get(kubectl, "pod", "probe", "-n", namespace)["spec"]
    assert (created["priorityClassName"], created["priority"]) == (
        "system-node-critical",
        2000001000,
    )
