"""A real etcd + kube-apiserver on loopback, started and stopped as plain processes.

`up` starts both detached (their own session), so they outlive the command that started them;
their pids and start times go into DIR/cluster.json at once, before readiness, so `down` finds
them even when the caller crashed half-way. `down` stops exactly those processes: it checks each
pid's start time (pids are reused) and, as a safety net, any etcd or kube-apiserver whose
arguments point into DIR. In-process users (the test fixture) can tie the children to their own
life with PR_SET_PDEATHSIG, so a killed test run leaves nothing behind either.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gpuusage import procfs
from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.binaries import Binaries, ensure_binaries, stderr_progress
from gpuusage_dev.localcluster.pki import Pki, create_pki

STATE_FILE = "cluster.json"
KUBECONFIG_FILE = "kubeconfig"
CONTEXT = "gpuusage-local"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
_OUR_PROGRAMS = ("etcd", "kube-apiserver")
Component = Literal["apiserver", "etcd"]
COMPONENTS: dict[Component, str] = {"apiserver": "kube-apiserver", "etcd": "etcd"}


class ClusterError(GpuusageError):
    """The local control plane could not be started or stopped."""


@dataclass
class ProcessRecord:
    """A started component: pid plus start time, so a reused pid is never mistaken for it."""

    name: str
    pid: int
    start_ticks: int | None


@dataclass
class ClusterState:
    """What DIR/cluster.json holds."""

    directory: str
    etcd_client_port: int
    etcd_peer_port: int
    apiserver_port: int
    processes: list[ProcessRecord] = field(default_factory=list)
    apiserver_args: list[str] = field(default_factory=list)
    """Flags `up` was given for the apiserver beyond ours: a restart keeps them."""
    authorization: str = "RBAC"
    kubernetes_version: str = ""
    """The release `up` started (see versions): a restart runs the same binaries."""

    @classmethod
    def load(cls, path: Path) -> ClusterState | None:
        try:
            raw = json.loads(path.read_text())
            raw["processes"] = [ProcessRecord(**p) for p in raw.get("processes", [])]
            return cls(**raw)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def die_with_parent() -> None:
    """In the child before exec: receive SIGTERM when the parent dies."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def is_running(record: ProcessRecord) -> bool:
    ticks = procfs.start_ticks(record.pid)
    if ticks is None or (record.start_ticks is not None and ticks != record.start_ticks):
        return False
    try:
        state = (procfs.DEFAULT_PROC_ROOT / str(record.pid) / "stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2 : state.rfind(")") + 3] != "Z"


def record_of(name: str, pid: int) -> ProcessRecord:
    """A record of a process just started (its start time read now)."""
    return ProcessRecord(name, pid, procfs.start_ticks(pid))


def kill(record: ProcessRecord, child: subprocess.Popen[Any] | None = None) -> None:
    """SIGKILL, as a crash or the OOM killer ends a process, to the recorded process if it is
    still the one recorded; `child`, when we started it, is reaped."""
    if is_running(record):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGKILL)
    if child is not None:
        child.wait(timeout=10)


def terminate(
    record: ProcessRecord, timeout: float, child: subprocess.Popen[Any] | None = None
) -> None:
    """SIGTERM, then SIGKILL after `timeout`, to the recorded process if it is still the one
    recorded (a reused pid is left alone); `child`, when we started it, is reaped (a child
    that is not the recorded process, one another process has since replaced, is only
    reaped if it ended)."""
    if child is not None and child.pid != record.pid:
        child.poll()
        child = None
    if not is_running(record):
        if child is not None:
            child.poll()
        return
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            return
        if child is None and not is_running(record):
            return
        time.sleep(0.05)
    try:
        os.kill(record.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if child is not None:
        child.wait(timeout=10)


def stop_child(process: subprocess.Popen[Any] | None, timeout: float = 10.0) -> None:
    """End a child this process started: SIGTERM, then SIGKILL after `timeout` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout)


def _stray_processes(directory: Path) -> list[ProcessRecord]:
    """etcd/kube-apiserver processes whose arguments point into directory."""
    needle = str(directory)
    found = []
    for pid in procfs.pids():
        argv = procfs.cmdline(pid)
        if not argv or Path(argv[0]).name not in _OUR_PROGRAMS:
            continue
        if any(needle in arg for arg in argv[1:]):
            found.append(ProcessRecord(Path(argv[0]).name, pid, procfs.start_ticks(pid)))
    return found


AUDIT_LOG = "audit.log"
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  # Kubernetes' own components (kubelets, the scheduler, the controller manager and the
  # controllers it runs under their service accounts) are not ours to judge.
  - level: None
    userGroups: ["system:nodes", "system:serviceaccounts:kube-system"]
  - level: None
    users: ["system:kube-scheduler", "system:kube-controller-manager"]
  - level: Metadata
"""
"""The audit policy of a control plane a node joins: every other request's metadata, which
carries the `k8s.io/deprecated` annotation where it asked for a deprecated API."""


def audit_args(directory: Path) -> list[str]:
    """The apiserver flags that write AUDIT_POLICY's log into `directory` (the policy file
    written there now)."""
    directory.mkdir(parents=True, exist_ok=True)
    policy = directory / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={directory / AUDIT_LOG}",
        "--audit-log-maxbackup=0",
        "--audit-log-format=json",
    ]


def deprecated_in_audit(log: str) -> list[str]:
    """`user: verb group/version resource` for each request an audit log marks as asking for a
    deprecated API, once each."""
    found = set()
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if (event.get("annotations") or {}).get("k8s.io/deprecated") != "true":
            continue
        ref = event.get("objectRef") or {}
        group = f"{ref['apiGroup']}/" if ref.get("apiGroup") else ""
        user = (event.get("user") or {}).get("username", "?")
        found.add(
            f"{user}: {event.get('verb')} {group}{ref.get('apiVersion', '?')} "
            f"{ref.get('resource', '?')}"
        )
    return sorted(found)


def deprecated_apis(metrics: str) -> list[str]:
    """`group/version resource[/subresource] (removed in R)` for each series of
    apiserver_requested_deprecated_apis in a /metrics text."""
    found = []
    for line in metrics.splitlines():
        if not line.startswith("apiserver_requested_deprecated_apis{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
        group = f"{labels['group']}/" if labels.get("group") else ""
        sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
        found.append(
            f"{group}{labels.get('version', '?')} {labels.get('resource', '?')}{sub}"
            f" (removed in {labels.get('removed_release') or 'a later release'})"
        )
    return sorted(found)


class LocalCluster:
    """One local control plane rooted at a directory."""

    def __init__(
        self,
        directory: Path,
        *,
        binaries: Binaries | None = None,
        apiserver_args: Sequence[str] = (),
        etcd_args: Sequence[str] = (),
        authorization_modes: Sequence[str] = ("RBAC",),
        tie_to_parent: bool = False,
        progress: Callable[[str], None] = stderr_progress,
        kubernetes_version: str | None = None,
    ) -> None:
        """`kubernetes_version`: the release to start (versions.choose: the default, or
        $GPUUSAGE_KUBERNETES_VERSION); a cluster already started keeps the one it runs."""
        self.directory = directory.resolve()
        self._binaries = binaries
        self._version = kubernetes_version
        self._apiserver_args = list(apiserver_args)
        self._authorization = ",".join(authorization_modes)
        self._etcd_args = list(etcd_args)
        self._tie_to_parent = tie_to_parent
        self._progress = progress
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._state: ClusterState | None = None
        self._pki: Pki | None = None

    # -- paths and facts -------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.directory / KUBECONFIG_FILE

    @property
    def state_path(self) -> Path:
        return self.directory / STATE_FILE

    @property
    def server(self) -> str:
        state = self._require_state()
        return f"https://127.0.0.1:{state.apiserver_port}"

    @property
    def kubernetes_version(self) -> str:
        """The release this cluster runs: the one its state records, else the one chosen."""
        state = self._state or ClusterState.load(self.state_path)
        if state is not None and state.kubernetes_version and self._version is None:
            return state.kubernetes_version
        return versions.choose(self._version)

    @property
    def binaries(self) -> Binaries:
        if self._binaries is None:
            self._binaries = ensure_binaries(self._progress, self.kubernetes_version)
        return self._binaries

    def log_path(self, component: str) -> Path:
        return self.directory / "logs" / f"{component}.log"

    def _require_state(self) -> ClusterState:
        if self._state is None:
            self._state = ClusterState.load(self.state_path)
        if self._state is None:
            raise ClusterError(f"no local cluster state in {self.directory}")
        return self._state

    # -- lifecycle -------------------------------------------------------------------------
    def up(self, timeout: float = 90.0) -> None:
        """Start etcd and kube-apiserver, wait for /readyz, write the kubeconfig."""
        existing = ClusterState.load(self.state_path)
        if existing and any(is_running(p) for p in existing.processes):
            raise ClusterError(
                f"a local cluster is already running in {self.directory}; "
                f"stop it with `gpuusage local-cluster down --dir {self.directory}`"
            )
        self._stop_strays()
        version = versions.choose(self._version)
        self._version = version
        binaries = self.binaries  # build before taking ports: it can take minutes
        for sub in ("etcd-data", "pki"):
            shutil.rmtree(self.directory / sub, ignore_errors=True)
        (self.directory / "logs").mkdir(parents=True, exist_ok=True)
        self._pki = create_pki(self.directory / "pki")
        for attempt in range(3):
            self._state = ClusterState(
                directory=str(self.directory),
                etcd_client_port=free_port(),
                etcd_peer_port=free_port(),
                apiserver_port=free_port(),
                apiserver_args=self._apiserver_args,
                authorization=self._authorization,
                kubernetes_version=version,
            )
            self._state.save(self.state_path)
            try:
                self._start("etcd", self._etcd_argv(binaries))
                self._start("kube-apiserver", self._apiserver_argv(binaries))
                self._write_kubeconfig()
                self.wait_ready(timeout)
                return
            except ClusterError as exc:
                port_clash = "address already in use" in str(exc)
                self.down()
                if not port_clash or attempt == 2:
                    raise
                self._progress("gpuusage: a port was taken meanwhile; retrying with new ports")

    def down(self, timeout: float = 20.0) -> list[ProcessRecord]:
        """Stop this cluster's processes (apiserver first) and return what was stopped."""
        state = ClusterState.load(self.state_path)
        records = list(reversed(state.processes)) if state else []
        known = {(r.pid, r.start_ticks) for r in records}
        records += [
            r for r in _stray_processes(self.directory) if (r.pid, r.start_ticks) not in known
        ]
        # The apiserver first: stopped after etcd, it waits for etcd until it is killed.
        records.sort(key=lambda r: r.name != "kube-apiserver")
        stopped = [r for r in records if is_running(r)]
        for record in stopped:
            self._terminate(record, timeout)
        if state:
            state.processes = []
            state.save(self.state_path)
        self._children.clear()
        return stopped

    def _stop_strays(self) -> None:
        for record in sorted(
            _stray_processes(self.directory), key=lambda r: r.name != "kube-apiserver"
        ):
            self._terminate(record, 20.0)

    def stop(self, component: Component, timeout: float = 20.0) -> None:
        """Stop one component and keep everything else (ports, certificates, etcd's data), so
        that `start` brings the same control plane back: how tests cut the API."""
        state = self._require_state()
        program = COMPONENTS[component]
        for record in [p for p in state.processes if p.name == program]:
            self._terminate(record, timeout)
            state.processes.remove(record)
        state.save(self.state_path)

    def start(self, component: Component, timeout: float = 90.0) -> None:
        """Start a stopped component again on its ports, with its certificates and data, and
        wait until the apiserver is ready (which needs etcd)."""
        state = self._require_state()
        program = COMPONENTS[component]
        if any(p.name == program and is_running(p) for p in state.processes):
            raise ClusterError(f"{program} of {self.directory} is already running")
        if self._pki is None:
            self._pki = self._existing_pki()
        argv = self._etcd_argv if component == "etcd" else self._apiserver_argv
        self._start(program, argv(self.binaries))
        if any(p.name == "kube-apiserver" and is_running(p) for p in state.processes):
            self.wait_ready(timeout)

    def restart(self, component: Component | None = None, timeout: float = 90.0) -> None:
        """Stop and start one component, or both (the apiserver stops first and starts last),
        on the same ports, certificates and data; returns once the apiserver is ready."""
        chosen: list[Component] = ["apiserver", "etcd"] if component is None else [component]
        for name in chosen:
            self.stop(name)
        for name in reversed(chosen):
            self.start(name, timeout)

    def stop_apiserver(self, timeout: float = 20.0) -> None:
        """Stop only kube-apiserver (etcd keeps the data), e.g. to test clients' resilience."""
        self.stop("apiserver", timeout)

    def start_apiserver(self, timeout: float = 90.0) -> None:
        """Start kube-apiserver again on the same port and wait until it is ready."""
        self.start("apiserver", timeout)

    def _existing_pki(self) -> Pki:
        d = self.directory / "pki"
        return Pki(
            d / "ca.crt",
            d / "ca.key",
            d / "apiserver.crt",
            d / "apiserver.key",
            d / "admin.crt",
            d / "admin.key",
            d / "sa.key",
            d / "sa.pub",
        )

    def _start(self, name: str, argv: list[str]) -> None:
        state = self._require_state()
        log = self.log_path(name).open("ab")
        try:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if self._tie_to_parent else None,  # noqa: PLW1509
            )
        finally:
            log.close()
        self._children[name] = child
        state.processes.append(ProcessRecord(name, child.pid, self._ticks_of(child.pid)))
        state.save(self.state_path)

    @staticmethod
    def _ticks_of(pid: int) -> int | None:
        for _ in range(50):
            ticks = procfs.start_ticks(pid)
            if ticks is not None:
                return ticks
            time.sleep(0.01)
        return None

    def _terminate(self, record: ProcessRecord, timeout: float) -> None:
        child = self._children.pop(record.name, None)
        if child is not None and child.pid != record.pid:
            self._children[record.name] = child
            child = None
        terminate(record, timeout, child)

    # -- arguments -------------------------------------------------------------------------
    def _etcd_argv(self, binaries: Binaries) -> list[str]:
        state = self._require_state()
        client = f"http://127.0.0.1:{state.etcd_client_port}"
        peer = f"http://127.0.0.1:{state.etcd_peer_port}"
        return [
            str(binaries.etcd),
            "--name=default",
            f"--data-dir={self.directory / 'etcd-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
            *self._etcd_args,
        ]

    def _apiserver_argv(self, binaries: Binaries) -> list[str]:
        state = self._require_state()
        pki = self._pki or self._existing_pki()
        return [
            str(binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{state.etcd_client_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # The `kubernetes` Service's endpoints would name the advertised address, which
            # 1.37 refuses on loopback; nothing routes a Service here (no kube-proxy): the
            # node's pods that call the apiserver use the host's network and 127.0.0.1
            # (localcluster.nodeinstall).
            "--endpoint-reconciler-type=none",
            f"--secure-port={state.apiserver_port}",
            f"--cert-dir={self.directory / 'pki'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--authorization-mode={state.authorization}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--profiling=false",
            *state.apiserver_args,
        ]

    # -- readiness and kubeconfig ----------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext:
        pki = self._pki or self._existing_pki()
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        return context

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Poll /readyz until it answers ok; fail early, with the log, if a process died."""
        deadline = time.monotonic() + timeout
        context = self._ssl_context()
        last = "no answer yet"
        while time.monotonic() < deadline:
            for name, child in self._children.items():
                if child.poll() is not None:
                    raise ClusterError(
                        f"{name} exited with code {child.returncode} while starting; "
                        f"last lines of {self.log_path(name)}:\n{self._log_tail(name)}"
                    )
            try:
                with urllib.request.urlopen(
                    f"{self.server}/readyz", context=context, timeout=5
                ) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise ClusterError(
            f"kube-apiserver not ready after {timeout:.0f} s ({last}); "
            f"last lines of its log:\n{self._log_tail('kube-apiserver')}"
        )

    def deprecated_requests_audited(self) -> list[str]:
        """The requests for deprecated APIs in this cluster's audit log (a cluster started
        with audit_args), by whom: on a cluster with a node, the components' own requests
        are left out of the log, which the gauge cannot tell apart."""
        path = self.directory / AUDIT_LOG
        return deprecated_in_audit(path.read_text(errors="replace")) if path.exists() else []

    def requested_deprecated_apis(self) -> list[str]:
        """The deprecated APIs this apiserver has served a request for since it started (its
        `apiserver_requested_deprecated_apis` gauge), as `group/version resource`."""
        with urllib.request.urlopen(
            f"{self.server}/metrics", context=self._ssl_context(), timeout=30
        ) as response:
            return deprecated_apis(response.read().decode())

    def _log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kubeconfig_dict(self) -> dict[str, Any]:
        pki = self._pki or self._existing_pki()

        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": CONTEXT,
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": b64(pki.ca_cert),
                    },
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate-data": b64(pki.admin_cert),
                        "client-key-data": b64(pki.admin_key),
                    },
                }
            ],
            "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": "admin"}}],
            "current-context": CONTEXT,
        }

    def _write_kubeconfig(self) -> None:
        tmp = self.kubeconfig.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.kubeconfig_dict(), sort_keys=False))
        tmp.chmod(0o600)
        os.replace(tmp, self.kubeconfig)

    def __enter__(self) -> LocalCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
