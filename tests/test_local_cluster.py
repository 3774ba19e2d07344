"""`gpuusage local-cluster up|down` as a user runs it: separate processes, real binaries."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuusage import procfs
from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.binaries import ensure_binaries
from gpuusage_dev.localcluster.cluster import (
    STATE_FILE,
    LocalCluster,
    ProcessRecord,
    deprecated_apis,
    deprecated_in_audit,
    is_running,
)
from gpuusage_dev.localcluster.node import node_cluster
from tests.conftest import CHILD_ENV, wait_for

pytestmark = pytest.mark.cluster


def _gpuusage(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "gpuusage.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=CHILD_ENV,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"gpuusage {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _live_processes_using(directory: Path) -> list[tuple[int, list[str]]]:
    """Every live process (zombies excluded) whose arguments mention directory."""
    found = []
    for pid in procfs.pids():
        argv = procfs.cmdline(pid)
        if not argv or not any(str(directory) in a for a in argv):
            continue
        if is_running(ProcessRecord("?", pid, procfs.start_ticks(pid))):
            found.append((pid, argv))
    return found


def test_up_gives_a_kubeconfig_kubectl_uses_and_down_leaves_nothing(tmp_path: Path) -> None:
    kubectl = ensure_binaries().kubectl
    out = _gpuusage("local-cluster", "up", "--dir", str(tmp_path), "--install-crds").stdout
    assert f"export KUBECONFIG={tmp_path}/kubeconfig" in out
    try:
        state = json.loads((tmp_path / STATE_FILE).read_text())
        assert {p["name"] for p in state["processes"]} == {"etcd", "kube-apiserver"}
        listed = subprocess.run(
            [str(kubectl), f"--kubeconfig={tmp_path / 'kubeconfig'}", "get", "gpunodeusages"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "No resources found" in listed.stderr
        version = subprocess.run(
            [str(kubectl), f"--kubeconfig={tmp_path / 'kubeconfig'}", "version"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"Server Version: {versions.DEFAULT}" in version.stdout
        assert state["kubernetes_version"] == versions.DEFAULT
        assert "WARNING" not in version.stderr  # same version: no skew warning
        assert len(_live_processes_using(tmp_path)) == 2

        again = _gpuusage("local-cluster", "up", "--dir", str(tmp_path), check=False)
        assert again.returncode == 1
        assert "already running" in again.stderr
    finally:
        down = _gpuusage("local-cluster", "down", "--dir", str(tmp_path)).stdout
    assert "kube-apiserver" in down
    assert "etcd" in down
    assert _live_processes_using(tmp_path) == []
    assert (
        "nothing was running" in _gpuusage("local-cluster", "down", "--dir", str(tmp_path)).stdout
    )


def test_an_unsupported_kubernetes_version_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    refused = _gpuusage(
        "local-cluster", "up", "--dir", str(tmp_path), "--kubernetes-version", "1.34", check=False
    )
    assert refused.returncode != 0
    assert "'1.34' is not one the local cluster runs" in refused.stderr
    assert ", ".join(versions.SUPPORTED) in refused.stderr
    assert "Traceback" not in refused.stderr
    assert _live_processes_using(tmp_path) == []


def test_down_cleans_up_after_the_caller_crashed(tmp_path: Path) -> None:
    """A caller killed while `up` waits for readiness leaves processes; `down` stops them."""
    ensure_binaries()
    caller = subprocess.Popen(
        [sys.executable, "-m", "gpuusage.cli", "local-cluster", "up", "--dir", str(tmp_path)],
        env=CHILD_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def started() -> int:
        """etcd and kube-apiserver started so far (the caller names the folder too)."""
        return len([p for p, _ in _live_processes_using(tmp_path) if p != caller.pid])

    deadline = time.monotonic() + 180  # a loaded machine starts the apiserver slowly
    while time.monotonic() < deadline and started() < 2:
        time.sleep(0.05)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    assert len(_live_processes_using(tmp_path)) == 2, "etcd and kube-apiserver outlive the caller"
    _gpuusage("local-cluster", "down", "--dir", str(tmp_path))
    assert _live_processes_using(tmp_path) == []


def test_down_finds_processes_missing_from_the_state_file(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, tie_to_parent=True)
    cluster.up()
    (tmp_path / STATE_FILE).unlink()  # as if the caller died before writing it
    stopped = LocalCluster(tmp_path).down()
    assert sorted(p.name for p in stopped) == ["etcd", "kube-apiserver"]
    assert _live_processes_using(tmp_path) == []


def test_apiserver_restart_keeps_data(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, tie_to_parent=True) as cluster:
        kubectl = [str(cluster.binaries.kubectl), f"--kubeconfig={cluster.kubeconfig}"]
        subprocess.run([*kubectl, "create", "namespace", "kept"], check=True, capture_output=True)
        cluster.stop_apiserver()
        failed = subprocess.run(
            [*kubectl, "get", "ns", "kept", "--request-timeout=2s"],
            capture_output=True,
            check=False,
        )
        assert failed.returncode != 0
        cluster.start_apiserver()
        again = subprocess.run(
            [*kubectl, "get", "ns", "kept"], capture_output=True, text=True, check=True
        )
        assert "kept" in again.stdout
    assert _live_processes_using(tmp_path) == []


def test_restart_command_brings_back_the_same_control_plane(tmp_path: Path) -> None:
    """`local-cluster restart`: same ports, certificates, data and Kubernetes release (here the
    oldest supported, asked for by its minor); each component and both."""
    out = _gpuusage(
        "local-cluster", "up", "--dir", str(tmp_path), "--kubernetes-version", versions.OLDEST[1:5]
    ).stdout
    assert f"(Kubernetes {versions.OLDEST})" in out
    try:
        oldest = ensure_binaries(version=versions.OLDEST).kubectl
        kubectl = [str(oldest), f"--kubeconfig={tmp_path / 'kubeconfig'}"]
        subprocess.run([*kubectl, "create", "namespace", "kept"], check=True, capture_output=True)
        before = json.loads((tmp_path / STATE_FILE).read_text())
        kubeconfig = (tmp_path / "kubeconfig").read_text()
        pids = {p["name"]: p["pid"] for p in before["processes"]}
        for component, replaced in (
            ("etcd", {"etcd"}),
            ("apiserver", {"kube-apiserver"}),
            (None, {"etcd", "kube-apiserver"}),
        ):
            args = ["--component", component] if component else []
            out = _gpuusage("local-cluster", "restart", "--dir", str(tmp_path), *args).stdout
            assert "ready at" in out
            after = json.loads((tmp_path / STATE_FILE).read_text())
            now = {p["name"]: p["pid"] for p in after["processes"]}
            assert {name for name in now if now[name] != pids[name]} == replaced
            pids = now
            ports = ("etcd_client_port", "etcd_peer_port", "apiserver_port")
            assert [after[k] for k in ports] == [before[k] for k in ports]
            assert (tmp_path / "kubeconfig").read_text() == kubeconfig, "same certificates"
            got = subprocess.run(
                [*kubectl, "get", "ns", "kept"], capture_output=True, text=True, check=True
            )
            assert "kept" in got.stdout, "etcd's data survived"
            server = subprocess.run(
                [*kubectl, "version"], check=True, capture_output=True, text=True
            )
            assert f"Server Version: {versions.OLDEST}" in server.stdout
        assert len(_live_processes_using(tmp_path)) == 2
    finally:
        _gpuusage("local-cluster", "down", "--dir", str(tmp_path))
    assert _live_processes_using(tmp_path) == []


def test_the_apiservers_deprecated_api_gauge_is_read_as_it_writes_it() -> None:
    metrics = (
        "# HELP apiserver_requested_deprecated_apis [STABLE] Gauge of deprecated APIs\n"
        'apiserver_requested_deprecated_apis{group="",removed_release="",resource="endpoints",'
        'subresource="",version="v1"} 1\n'
        'apiserver_requested_deprecated_apis{group="resource.k8s.io",removed_release="1.38",'
        'resource="resourceclaims",subresource="status",version="v1beta1"} 1\n'
        'apiserver_request_total{code="200",group="",resource="pods",verb="LIST"} 3\n'
    )
    assert deprecated_apis(metrics) == [
        "resource.k8s.io/v1beta1 resourceclaims/status (removed in 1.38)",
        "v1 endpoints (removed in a later release)",
    ]


def test_a_deprecated_request_shows_in_the_gauge_the_suite_checks(tmp_path: Path) -> None:
    """What the suite's clusters check at their end can see a deprecated request: v1
    Endpoints, deprecated since 1.33, asked for once."""
    with LocalCluster(tmp_path, tie_to_parent=True) as local:
        assert local.requested_deprecated_apis() == []
        kubectl = [str(local.binaries.kubectl), f"--kubeconfig={local.kubeconfig}"]
        subprocess.run([*kubectl, "get", "endpoints", "-A"], check=True, capture_output=True)
        assert local.requested_deprecated_apis() == ["v1 endpoints (removed in a later release)"]


def test_a_node_clusters_audit_names_who_asked_for_a_deprecated_api(tmp_path: Path) -> None:
    """On a control plane a node joins, the controllers' own requests for v1 Endpoints fill
    the gauge: the audit log names the requests of everyone else, and by whom."""
    with node_cluster(tmp_path, tie_to_parent=True) as local:
        kubectl = [str(local.binaries.kubectl), f"--kubeconfig={local.kubeconfig}"]
        subprocess.run([*kubectl, "get", "namespaces"], check=True, capture_output=True)
        assert local.deprecated_requests_audited() == []
        subprocess.run([*kubectl, "get", "endpoints", "-A"], check=True, capture_output=True)
        found = wait_for(local.deprecated_requests_audited, what="the request in the audit log")
        assert found == ["gpuusage-admin: list v1 endpoints"]


def test_the_audit_log_is_read_as_the_apiserver_writes_it() -> None:
    deprecated = {
        "kind": "Event",
        "verb": "watch",
        "user": {"username": "system:serviceaccount:gpuusage-system:gpuusage-operator"},
        "objectRef": {
            "resource": "resourceclaims",
            "apiGroup": "resource.k8s.io",
            "apiVersion": "v1beta1",
        },
        "annotations": {"k8s.io/deprecated": "true", "k8s.io/removed-release": "1.38"},
    }
    current = {**deprecated, "annotations": {}}
    log = "\n".join(
        [json.dumps(deprecated), "not json", json.dumps(current), json.dumps(deprecated)]
    )
    assert deprecated_in_audit(log) == [
        "system:serviceaccount:gpuusage-system:gpuusage-operator: watch "
        "resource.k8s.io/v1beta1 resourceclaims"
    ]
