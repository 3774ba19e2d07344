"""A real Prometheus on loopback that asks who is calling, as a fleet's does: basic auth and TLS
from its `--web.config.file`, its series loaded beforehand as TSDB blocks.

The server is Prometheus itself at promtool's release (tools.PROMETHEUS), built from its Go
module; the series are written as OpenMetrics and turned into blocks by `promtool tsdb
create-blocks-from openmetrics`, so a query over hours needs no hours of scraping. The web
config's password is bcrypt-hashed by a tiny Go program beside this file (main.go); the CA and
the serving certificate (for 127.0.0.1) are the local control plane's kind, made with openssl.
"""

from __future__ import annotations

import base64
import secrets
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuusage.errors import GpuusageError
from gpuusage.retry import poll_until
from gpuusage_dev.localcluster.binaries import (
    Progress,
    ensure_go_program,
    stderr_progress,
)
from gpuusage_dev.localcluster.cluster import free_port, stop_child
from gpuusage_dev.localcluster.pki import Pki, create_pki
from gpuusage_dev.localcluster.tools import PROMETHEUS, PROMTOOL, ensure_tool

SOURCE = Path(__file__).with_name("main.go")
CRYPTO_MODULE = "golang.org/x/crypto v0.39.0"
"""The x/crypto Prometheus 3.5.0 is built with (its bcrypt checks the hashes)."""


class LocalPrometheusError(GpuusageError):
    """The local Prometheus, or its series, could not be made ready."""


def ensure_bcrypt_hash(progress: Progress = stderr_progress) -> Path:
    """The hasher's binary, built once per version of its source into the cache."""
    return ensure_go_program(
        "bcrypt-hash",
        SOURCE,
        (CRYPTO_MODULE,),
        "gpuusage builds a bcrypt hasher (for Prometheus' web config) from Go modules once.",
        progress,
    )


def bcrypt_hash(password: str) -> str:
    """The bcrypt hash of `password` (the hasher reads it from stdin: never an argument)."""
    done = subprocess.run(
        [str(ensure_bcrypt_hash())],
        input=password,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise LocalPrometheusError(f"bcrypt-hash failed: {done.stderr.strip()}")
    return done.stdout.strip()


def openmetrics(series: Mapping[str, float], times: Sequence[int]) -> str:
    """OpenMetrics text of gauges: each series (`name{labels}`) at each time (Unix seconds)
    with its value; a family's series together, as the format wants."""
    families: dict[str, list[str]] = {}
    for selector in series:
        families.setdefault(selector.split("{", 1)[0], []).append(selector)
    lines = []
    for name, selectors in families.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f"{s} {series[s]!r} {t}" for s in selectors for t in times]
    return "\n".join([*lines, "# EOF", ""])


@dataclass
class LocalPrometheus:
    """One Prometheus process below `directory`: HTTPS on 127.0.0.1, basic auth for `user`."""

    directory: Path
    user: str = "gpuusage"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[Any] | None = None
    pki: Pki | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def data(self) -> Path:
        return self.directory / "data"

    def load(self, series: Mapping[str, float], times: Sequence[int]) -> None:
        """The series as TSDB blocks in the data folder (before `start`: Prometheus reads its
        blocks when it starts)."""
        source = self.directory / "series.om"
        self.directory.mkdir(parents=True, exist_ok=True)
        source.write_text(openmetrics(series, times))
        made = subprocess.run(
            [
                str(ensure_tool(PROMTOOL)),
                "tsdb",
                "create-blocks-from",
                "openmetrics",
                "--quiet",
                str(source),
                str(self.data),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode != 0:
            raise LocalPrometheusError(f"promtool could not make the blocks:\n{made.stderr}")

    def trust(self) -> ssl.SSLContext:
        """A client's TLS context that trusts this server's CA."""
        assert self.pki is not None, "start() makes the CA"
        return ssl.create_default_context(cafile=str(self.pki.ca_cert))

    def _ready(self) -> bool:
        request = urllib.request.Request(f"{self.url}/-/ready")
        request.add_header("Authorization", _basic(self.user, self.password))
        try:
            with urllib.request.urlopen(request, timeout=2, context=self.trust()) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def start(self, timeout: float = 60.0) -> LocalPrometheus:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pki = create_pki(self.directory / "pki")
        config = self.directory / "prometheus.yml"
        config.write_text("global:\n  evaluation_interval: 1m\n")
        web = self.directory / "web.yml"
        web.write_text(
            "tls_server_config:\n"
            f"  cert_file: {self.pki.serving_cert}\n"
            f"  key_file: {self.pki.serving_key}\n"
            "basic_auth_users:\n"
            f"  {self.user}: {bcrypt_hash(self.password)}\n"
        )
        log_path = self.directory / "prometheus.log"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    str(ensure_tool(PROMETHEUS)),
                    f"--config.file={config}",
                    f"--web.config.file={web}",
                    f"--storage.tsdb.path={self.data}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=log,
            )
        up = poll_until(
            lambda: (
                self.process is not None and self.process.poll() is None and (self._ready() or None)
            ),
            timeout,
            0.2,
        )
        if not up:
            self.stop()
            said = log_path.read_text()[-2000:]
            raise LocalPrometheusError(f"Prometheus did not get ready at {self.url}:\n{said}")
        return self

    def stop(self) -> None:
        stop_child(self.process)
        self.process = None


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


@contextmanager
def running_prometheus(
    directory: Path, series: Mapping[str, float], times: Sequence[int]
) -> Iterator[LocalPrometheus]:
    """A started Prometheus holding `series` at `times`, stopped on leaving."""
    prometheus = LocalPrometheus(directory)
    prometheus.load(series, times)
    prometheus.start()
    try:
        yield prometheus
    finally:
        prometheus.stop()
