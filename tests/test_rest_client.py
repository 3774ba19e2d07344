"""The agent's small REST client: kubeconfig handling, and real auth on the local apiserver."""

from __future__ import annotations

import subprocess
import sys
import urllib.parse
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from gpuusage.kube.config import KubeConfigError
from gpuusage.kube.errors import Forbidden, NotFound, TransientApiError
from gpuusage.kube.rest import (
    RestClient,
    RestConfig,
    _proxy_for,
    config_from_kubeconfig,
    in_cluster_config,
)
from gpuusage.retry import poll_until
from gpuusage_dev.localcluster.cluster import LocalCluster, free_port
from tests.tcpproxy import tcp_proxy


def _kubeconfig(
    path: Path,
    context: str | None,
    clusters: dict[str, dict[str, object]],
    users: dict[str, dict[str, object]],
) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "current-context": context,
                "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
                "users": [{"name": n, "user": u} for n, u in users.items()],
                "contexts": [{"name": n, "context": {"cluster": n, "user": n}} for n in clusters],
            }
        )
    )
    return path


def test_kubeconfig_files_merge_first_wins_and_paths_are_relative(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = _kubeconfig(
        tmp_path / "a" / "config",
        "one",
        {"one": {"server": "https://one:6443", "certificate-authority": "ca.pem"}},
        {"one": {"token": "t1", "client-certificate": "/abs/c.pem"}},
    )
    second = _kubeconfig(
        tmp_path / "config2",
        "two",
        {"one": {"server": "https://ignored"}, "two": {"server": "https://two/"}},
        {"two": {"tokenFile": "tok"}},
    )
    merged = config_from_kubeconfig([first, second], tmp_path)
    assert merged == RestConfig(
        server="https://one:6443",
        ca_file=tmp_path / "a" / "ca.pem",
        cert_file=Path("/abs/c.pem"),
        token="t1",
    )
    only_second = config_from_kubeconfig([second], tmp_path)
    assert only_second.server == "https://two"
    assert only_second.token_file == tmp_path / "tok"


def test_exec_credentials_are_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = _kubeconfig(
        tmp_path / "c",
        "eks",
        {"eks": {"server": "https://x"}},
        {"eks": {"exec": {"command": "aws"}}},
    )
    with pytest.raises(KubeConfigError, match="exec/auth-provider credentials"):
        config_from_kubeconfig([path], tmp_path)


def test_missing_context_is_reported(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "c", None, {"x": {"server": "https://x"}}, {"x": {}})
    with pytest.raises(KubeConfigError, match="has no current context"):
        config_from_kubeconfig([path], tmp_path)


def test_in_cluster_config_handles_ipv6() -> None:
    config = in_cluster_config(
        {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    )
    assert config.server == "https://[fd00::1]:443"
    assert config.token_file is not None


def test_agent_does_not_load_the_kubernetes_package() -> None:
    code = (
        "import sys, gpuusage_nodeagent.main; "
        "sys.exit(any(m.split('.')[0] == 'kubernetes' for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.cluster
def test_client_certificate_kubeconfig_and_inline_data_cleanup(cluster: LocalCluster) -> None:
    rest, source = RestClient.from_kubeconfig(cluster.kubeconfig)
    with rest:
        assert source.origin == "flag"
        assert rest.get("/api/v1/namespaces/default")["metadata"]["name"] == "default"
        with pytest.raises(NotFound, match="not found"):
            rest.get("/api/v1/nodes/no-such-node")
        scratch = rest.config.ca_file
        assert scratch is not None
        assert scratch.exists()
    assert not scratch.exists(), "credential files are removed on close"


@pytest.mark.cluster
def test_service_account_token_and_rbac(
    cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(
        "default", client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="rest-reader"))
    )
    issued = core.create_namespaced_service_account_token(
        "rest-reader", "default", client.AuthenticationV1TokenRequest(spec={"audiences": []})
    )
    assert issued.status is not None
    token_file = tmp_path / "token"
    token_file.write_text(f"{issued.status.token}\n")
    ca = tmp_path / "ca.crt"
    ca.write_bytes((cluster.directory / "pki" / "ca.crt").read_bytes())
    rest = RestClient(RestConfig(server=cluster.server, ca_file=ca, token_file=token_file))
    with pytest.raises(Forbidden, match='User "system:serviceaccount:default:rest-reader"'):
        rest.get("/api/v1/nodes")
    rule = client.V1PolicyRule(api_groups=[""], resources=["nodes"], verbs=["list"])
    rbac.create_cluster_role(
        client.V1ClusterRole(metadata=client.V1ObjectMeta(name="rest-reader"), rules=[rule])
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name="rest-reader"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="rest-reader"
            ),
            subjects=[
                client.RbacV1Subject(kind="ServiceAccount", name="rest-reader", namespace="default")
            ],
        )
    )

    def listed() -> bool:
        try:
            return "items" in rest.get("/api/v1/nodes")
        except Forbidden:  # the authorizer's cache sees a new binding a moment later
            return False

    assert poll_until(listed, 15, 0.1), "the binding's right granted"
    token_file.write_text("rotated-garbage")  # the token is re-read on every request
    with pytest.raises(Forbidden, match="401"):
        rest.get("/api/v1/nodes")


def test_no_answer_is_transient(tmp_path: Path) -> None:
    rest = RestClient(RestConfig(server=f"https://127.0.0.1:{free_port()}"), timeout=2)
    with pytest.raises(TransientApiError, match="no answer"):
        rest.get("/version")


def test_one_connection_serves_every_request_and_an_idle_close_is_survived(
    cluster: LocalCluster,
) -> None:
    """The agent's client keeps its TLS connection open (one handshake, not one a request);
    a connection the server closed while idle is replaced without the caller seeing it; a
    server that is gone is a transient error."""
    rest, _ = RestClient.from_kubeconfig(cluster.kubeconfig)
    server = urllib.parse.urlsplit(cluster.server)
    with rest, tcp_proxy((server.hostname or "", server.port or 443)) as proxy:
        through = RestClient(
            replace(rest.config, server=f"https://127.0.0.1:{proxy.port}"), timeout=5
        )
        for _ in range(20):
            assert through.get("/api/v1/namespaces/default")["metadata"]["name"] == "default"
        assert (through.connections_opened, proxy.accepted) == (1, 1)
        proxy.cut()  # as a server closes an idle keep-alive connection
        assert through.get("/version")["major"] == "1"
        assert (through.connections_opened, proxy.accepted) == (2, 2)
        with pytest.raises(NotFound):  # an error answer keeps the connection
            through.get("/api/v1/nodes/no-such-node")
        through.get("/version")
        assert proxy.accepted == 2
        proxy.close()
        with pytest.raises(TransientApiError, match="no answer"):
            through.get("/version")
        through.close()


def test_requests_go_through_the_environments_proxy_unless_exempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = urllib.parse.urlsplit("https://10.0.0.1:6443")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", "")
    found = _proxy_for(server)
    assert found is not None
    assert (found.hostname, found.port) == ("proxy.corp", 3128)
    monkeypatch.setenv("NO_PROXY", "10.0.0.1")
    assert _proxy_for(server) is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.delenv("https_proxy", raising=False)
    assert _proxy_for(server) is None
