"""A CNCF Distribution registry on loopback, where a release is proven end to end: pushed,
signed, pulled by digest by the node's containerd, installed with helm from OCI, verified with
cosign. Plain HTTP on 127.0.0.1, as registry clients speak to a loopback registry; the real
registry program, built from its Go module (tools.REGISTRY), its storage in a folder of the
caller's."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuusage.errors import GpuusageError
from gpuusage.retry import poll_until
from gpuusage_dev.localcluster.cluster import free_port, stop_child
from gpuusage_dev.localcluster.tools import REGISTRY, ensure_tool


class RegistryError(GpuusageError):
    """The local registry did not start."""


@dataclass
class LocalRegistry:
    """One registry process and its storage below `directory`."""

    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[Any] | None = None

    @property
    def host(self) -> str:
        """host:port, as image references and `oci://` addresses name it."""
        return f"127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def start(self, timeout: float = 30.0) -> LocalRegistry:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.directory / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n"
        )
        log = (self.directory / "registry.log").open("ab")
        self.process = subprocess.Popen(
            [str(ensure_tool(REGISTRY)), "serve", str(config)], stdout=log, stderr=log
        )
        if not poll_until(
            lambda: self.process is not None and (self._answers() or None), timeout, 0.1
        ):
            self.stop()
            said = (self.directory / "registry.log").read_text()[-1500:]
            raise RegistryError(f"the registry did not answer on {self.host}:\n{said}")
        return self

    def stop(self) -> None:
        stop_child(self.process)
        self.process = None


@contextmanager
def running_registry(directory: Path) -> Iterator[LocalRegistry]:
    """A started registry, stopped on leaving."""
    registry = LocalRegistry(directory).start()
    try:
        yield registry
    finally:
        registry.stop()
