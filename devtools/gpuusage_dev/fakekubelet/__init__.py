"""A kubelet PodResources server for tests and the demo: the kubelet's own generated code and
gRPC server, built from Go modules (main.go beside this file) and cached like the control plane.

`FakeKubelet` runs it on a unix socket; what `List`, `Get` and `GetAllocatableResources` answer
is the JSON last given to `answer` (the protobuf field names), re-read on every call. It answers
as kubelet 1.37 does (the devices DRA drivers prepared listed per container, `Get` served), or
as an older kubelet (`kubelet="1.35-gates-off"`: the DRA listing and `Get` turned off;
`kubelet="1.26"`: neither exists).
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuusage_dev.localcluster.binaries import (
    BinariesError,
    Progress,
    ensure_go_program,
    stderr_progress,
)

SOURCE = Path(__file__).with_name("main.go")
KUBELET_MODULE = "k8s.io/kubelet v0.37.2"  # the PodResources API of kubelet 1.37
GRPC_MODULE = "google.golang.org/grpc v1.82.1"  # the gRPC server kubelet 1.37 is built with


def ensure_fake_kubelet(progress: Progress = stderr_progress) -> Path:
    """The binary, built once per version of its source into the cache."""
    return ensure_go_program(
        "fake-kubelet",
        SOURCE,
        (KUBELET_MODULE, GRPC_MODULE),
        "gpuusage builds its fake kubelet (PodResources API) from Go modules once.",
        progress,
    )


class FakeKubelet:
    """The fake kubelet on `socket`, answering what `answer` last wrote."""

    def __init__(self, socket: Path, binary: Path | None = None) -> None:
        self.socket = socket
        socket.parent.mkdir(parents=True, exist_ok=True)
        self.answers = socket.with_name(socket.name + ".json")
        self.binary = binary or ensure_fake_kubelet()
        self.calls = 0
        """List calls answered."""
        self.gets = 0
        """Get calls answered."""
        self._process: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._answered = threading.Condition()

    def answer(self, body: dict[str, Any]) -> None:
        """What List answers from now on (written whole, then renamed: never read half)."""
        staged = self.answers.with_name(self.answers.name + ".new")
        staged.write_text(json.dumps(body))
        staged.replace(self.answers)

    def pods(
        self,
        *pods: dict[str, Any],
        advertised: dict[str, list[str]] | None = None,
        kubelet: str = "1.37",
    ) -> None:
        """List answers `pods` (and Get each of them); GetAllocatableResources, the
        `advertised` device IDs by resource name (none by default); `kubelet`, whose
        behaviour it shows (see main.go)."""
        devices = [{"resource_name": r, "device_ids": ids} for r, ids in (advertised or {}).items()]
        self.answer(
            {"pod_resources": list(pods), "allocatable": {"devices": devices}, "kubelet": kubelet}
        )

    def start(self) -> FakeKubelet:
        if not self.answers.exists():
            self.pods()
        self._process = subprocess.Popen(
            [str(self.binary), "--socket", str(self.socket), "--answers", str(self.answers)],
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._count, daemon=True).start()
        if not self._ready.wait(30):
            self.stop()
            raise BinariesError("the fake kubelet did not start listening within 30s")
        return self

    def _count(self) -> None:
        process = self._process
        assert process is not None
        assert process.stdout is not None
        for line in process.stdout:
            if line.strip() == "ready":
                self._ready.set()
            elif line.startswith("list "):
                with self._answered:
                    self.calls = int(line.split()[1])
                    self._answered.notify_all()
            elif line.startswith("get "):
                with self._answered:
                    self.gets = int(line.split()[1])
                    self._answered.notify_all()

    def wait_calls(self, count: int, timeout: float = 10.0) -> None:
        """Wait until List has answered `count` calls in all."""
        with self._answered:
            if not self._answered.wait_for(lambda: self.calls >= count, timeout):
                raise TimeoutError(
                    f"the fake kubelet answered {self.calls} List calls, not {count}"
                )

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._process = None

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
