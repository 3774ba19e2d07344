"""A small REST client for the node agent's three calls, without the `kubernetes` package.

The agent runs on every GPU node, so its footprint matters: importing the `kubernetes` client
alone costs more resident memory than the rest of the agent together (measured in
benchmarks/README.md). The agent only reads its Node and creates or merge-patches one custom
object, which the standard library does well.

Credentials supported, looked for in this order (--kubeconfig, $KUBECONFIG, in-cluster, ~/.kube):
the in-cluster service-account token (re-read on every request, since bound tokens rotate),
and kubeconfig users with client certificates or bearer tokens (inline or as files). Users
with `exec` or `auth-provider` plugins are refused with a clear message: in a cluster the agent
uses its service account, and the operator (which uses the full client) takes any kubeconfig.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import ssl
import tempfile
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuusage.kube.config import IN_CLUSTER_TOKEN, ApiSource, KubeConfigError, choose_source
from gpuusage.kube.errors import ApiError, TransientApiError, from_status

IN_CLUSTER_CA = IN_CLUSTER_TOKEN.parent / "ca.crt"
USER_AGENT = "gpuusage-agent"
IDLE_CLOSED = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
)
"""How a kept connection the server closed while idle fails on its next request."""
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class RestConfig:
    """Where the API is and how to authenticate, resolved to files."""

    server: str
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None
    token_file: Path | None = None
    insecure: bool = False


def _merged(paths: list[Path]) -> dict[str, Any]:
    """kubectl's merge of several kubeconfig files: the first file to name an entry wins."""
    merged: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": None}
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise KubeConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
        if not isinstance(doc, dict):
            raise KubeConfigError(f"kubeconfig {path} is not a mapping")
        if not merged["current-context"]:
            merged["current-context"] = doc.get("current-context")
        for section, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in doc.get(section) or []:
                merged[section].setdefault(entry.get("name"), (entry.get(key) or {}, path.parent))
    return merged


def _materialise(data: str, directory: Path, name: str) -> Path:
    """Inline base64 data written to a private file: the ssl module loads certificates only
    from files."""
    path = directory / name
    path.write_bytes(base64.b64decode(data))
    path.chmod(0o600)
    return path


def _file(value: str | None, base: Path) -> Path | None:
    if not value:
        return None
    path = Path(value)
    return path if path.is_absolute() else base / path


def config_from_kubeconfig(paths: list[Path], scratch: Path) -> RestConfig:
    """The current context of (merged) kubeconfig files as a RestConfig."""
    merged = _merged(paths)
    current = merged.get("current-context")
    if not current or current not in merged["contexts"]:
        raise KubeConfigError(f"kubeconfig {', '.join(map(str, paths))} has no current context")
    context, _ = merged["contexts"][current]
    cluster, cluster_dir = merged["clusters"].get(context.get("cluster"), ({}, Path()))
    user, user_dir = merged["users"].get(context.get("user"), ({}, Path()))
    if not cluster.get("server"):
        raise KubeConfigError(f"context {current!r} names no cluster with a server")
    if "exec" in user or "auth-provider" in user:
        raise KubeConfigError(
            f"user of context {current!r} uses exec/auth-provider credentials, which the agent "
            "does not support; use a client certificate or a token (in a cluster the agent "
            "uses its service account)"
        )
    ca = _file(cluster.get("certificate-authority"), cluster_dir)
    if cluster.get("certificate-authority-data"):
        ca = _materialise(cluster["certificate-authority-data"], scratch, "ca.crt")
    cert = _file(user.get("client-certificate"), user_dir)
    if user.get("client-certificate-data"):
        cert = _materialise(user["client-certificate-data"], scratch, "client.crt")
    key = _file(user.get("client-key"), user_dir)
    if user.get("client-key-data"):
        key = _materialise(user["client-key-data"], scratch, "client.key")
    return RestConfig(
        server=str(cluster["server"]).rstrip("/"),
        ca_file=ca,
        cert_file=cert,
        key_file=key,
        token=user.get("token"),
        token_file=_file(user.get("tokenFile"), user_dir),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


def in_cluster_config(environ: dict[str, str] | None = None) -> RestConfig:
    environ = dict(os.environ) if environ is None else environ
    host = environ["KUBERNETES_SERVICE_HOST"]
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    return RestConfig(
        server=f"https://{host}:{port}", ca_file=IN_CLUSTER_CA, token_file=IN_CLUSTER_TOKEN
    )


def load_rest_config(kubeconfig: Path | None, scratch: Path) -> tuple[RestConfig, ApiSource]:
    """Resolve the API the way kubectl does (see gpuusage.kube.config.choose_source)."""
    source = choose_source(kubeconfig)
    if source.origin == "in-cluster":
        return in_cluster_config(), source
    paths = [Path(p) for p in source.detail.split(os.pathsep) if p]
    return config_from_kubeconfig(paths, scratch), source


def _proxy_for(server: urllib.parse.SplitResult) -> urllib.parse.SplitResult | None:
    """The proxy the environment names for this server (HTTPS_PROXY, HTTP_PROXY), unless
    NO_PROXY exempts it; requests then go through a CONNECT tunnel."""
    found = urllib.request.getproxies().get(server.scheme)
    if not found or urllib.request.proxy_bypass(server.netloc):
        return None
    proxy = urllib.parse.urlsplit(found if "://" in found else f"http://{found}")
    return proxy if proxy.hostname else None


def encode(body: Any) -> bytes:
    """A request body as sent: JSON without optional spaces (a tenth of a report's bytes)."""
    return json.dumps(body, separators=(",", ":")).encode()


class RestClient:
    """JSON over HTTPS with the configured credentials; errors as gpuusage.kube.errors.

    Each thread keeps its connection open across requests, as client-go does: a new TLS
    handshake per request costs the agent and the apiserver far more than the request itself
    (about 500 handshakes a second at 5,000 nodes; benchmarks/README.md). A connection the
    server closed while idle is noticed on the next request, which is sent again once on a new
    connection; any other failure closes the connection and is a TransientApiError.
    """

    def __init__(
        self, config: RestConfig, timeout: float = 10.0, scratch: Path | None = None
    ) -> None:
        self.config = config
        self.timeout = timeout
        self._scratch = scratch
        context = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
        if config.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if config.cert_file and config.key_file:
            context.load_cert_chain(str(config.cert_file), str(config.key_file))
        self._context = context
        server = urllib.parse.urlsplit(config.server)
        if server.scheme not in ("https", "http") or not server.hostname:
            raise KubeConfigError(f"server {config.server!r} is not an http(s) URL")
        self._server = server
        self._prefix = server.path.rstrip("/")
        self._local = threading.local()
        self.connections_opened = 0
        """How many connections this client has opened (for tests and benchmarks)."""

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's open connection, or a new one; whether it is new."""
        found: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if found is not None:
            return found, False
        host, port = self._server.hostname or "", self._server.port
        proxy = _proxy_for(self._server)
        to_host, to_port = (proxy.hostname or "", proxy.port) if proxy else (host, port)
        if self._server.scheme == "https":
            made: http.client.HTTPConnection = http.client.HTTPSConnection(
                to_host, to_port, timeout=self.timeout, context=self._context
            )
        else:
            made = http.client.HTTPConnection(to_host, to_port, timeout=self.timeout)
        if proxy is not None:  # HTTPS_PROXY / NO_PROXY, as client-go honours them
            made.set_tunnel(host, port)
        self._local.connection = made
        self.connections_opened += 1
        return made, True

    def close_connection(self) -> None:
        """Close this thread's connection; the next request opens a new one."""
        found: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        self._local.connection = None
        if found is not None:
            found.close()

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path | None) -> tuple[RestClient, ApiSource]:
        scratch = Path(tempfile.mkdtemp(prefix="gpuusage-creds-"))
        try:
            config, source = load_rest_config(kubeconfig, scratch)
            return cls(config, scratch=scratch), source
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise

    def close(self) -> None:
        """Close this thread's connection; remove credential files written from inline
        kubeconfig data."""
        self.close_connection()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _token(self) -> str | None:
        if self.config.token_file is not None:
            try:
                return self.config.token_file.read_text().strip()
            except OSError as exc:
                raise TransientApiError(
                    f"cannot read token {self.config.token_file}: {exc}"
                ) from exc
        return self.config.token

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        data = None if body is None else encode(body)
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if data is not None:
            headers["Content-Type"] = content_type
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        status, payload = self._exchange(method, self._prefix + path, data, headers)
        if status >= 400:
            raise from_status(status, payload)
        try:
            parsed = json.loads(payload or b"{}")
        except ValueError as exc:
            raise ApiError(f"{method} {path}: the answer is not JSON") from exc
        return parsed if isinstance(parsed, dict) else {"items": parsed}

    def _exchange(
        self, method: str, target: str, data: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """One request and its whole answer on this thread's connection. A kept connection
        the server closed while idle fails before any answer: the request is sent again once
        on a new one (the server never saw it)."""
        for _attempt in range(2):
            connection, new = self._connection()
            try:
                connection.request(method, target, body=data, headers=headers)
                response = connection.getresponse()
                payload = response.read()
            except IDLE_CLOSED as exc:
                self.close_connection()
                if new:
                    raise TransientApiError(f"no answer from {self.config.server}: {exc}") from exc
                continue
            except (http.client.HTTPException, OSError, TimeoutError) as exc:
                self.close_connection()
                raise TransientApiError(f"no answer from {self.config.server}: {exc}") from exc
            if response.will_close:
                self.close_connection()
            return response.status, payload
        raise TransientApiError(f"no answer from {self.config.server}")  # pragma: no cover

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> dict[str, Any]:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        return self.request("PATCH", path, body, MERGE_PATCH)
