"""A kubeconfig whose user is an exec credential plugin (what EKS, GKE and AKS write) works for
the operator (kopf's login included) and for `gpuusage top`, on the real apiserver."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import Background, ensure_namespace
from gpuusage_operator.main import run_operator
from gpuusage_operator.settings import OperatorSettings
from tests.conftest import CHILD_ENV, WorldFactory, wait_for
from tests.simworld import SimWorld
from tests.worldview import condition, pod

pytestmark = pytest.mark.cluster


def exec_kubeconfig(cluster: LocalCluster, api: client.ApiClient, tmp_path: Path) -> Path:
    """A ServiceAccount bound to cluster-admin whose token only an exec plugin hands out."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    ns = f"exec-{uuid.uuid4().hex[:6]}"
    ensure_namespace(core, ns)
    core.create_namespaced_service_account(
        ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="laptop"))
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=ns),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="cluster-admin"
            ),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="laptop", namespace=ns)],
        )
    )
    request = client.AuthenticationV1TokenRequest(spec={"audiences": [], "expirationSeconds": 3600})
    issued = core.create_namespaced_service_account_token("laptop", ns, request)
    assert issued.status is not None
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": issued.status.token},
    }
    plugin = tmp_path / "credential-plugin"
    plugin.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(credential)}\nEOF\n")
    plugin.chmod(0o755)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "laptop",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": cluster.server,
                    "certificate-authority": str(cluster.directory / "pki" / "ca.crt"),
                },
            }
        ],
        "users": [
            {
                "name": "laptop",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": str(plugin),
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
        "contexts": [{"name": "laptop", "context": {"cluster": "local", "user": "laptop"}}],
    }
    path = tmp_path / "exec.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_operator_and_top_work_with_an_exec_plugin_kubeconfig(
    make_world: WorldFactory, cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> None:
    world: SimWorld = make_world(operator=False)
    kubeconfig = exec_kubeconfig(cluster, api, tmp_path)
    settings = OperatorSettings(kubeconfig=kubeconfig, standalone=True, resync=0.5)
    ready = threading.Event()
    operator = Background(lambda stop: run_operator(settings, stop, ready))
    try:
        assert ready.wait(60), "the operator did not log in with the exec plugin"
        wait_for(
            lambda: condition(pod(world, "train")).status == "True",
            what="the pod marked by an operator logged in through the plugin",
        )
    finally:
        operator.halt()
    top = subprocess.run(
        [sys.executable, "-m", "gpuusage.cli", "top", "-A", "--kubeconfig", str(kubeconfig)],
        capture_output=True,
        text=True,
        check=False,
        env=CHILD_ENV,
        timeout=60,
    )
    assert top.returncode == 0, top.stderr
    assert world.ns in top.stdout
