"""A device plugin of ours for the local cluster's real node: the kubelet's device-plugin API
(k8s.io/kubelet deviceplugin v1beta1) served by the kubelet's own gRPC, built from Go modules
(main.go beside this file) and cached like the control plane.

It advertises the GPUs of a GPU scenario (the fake source's format): each whole GPU's UUID as an
`nvidia.com/gpu` device and each MIG device's UUID under `nvidia.com/mig-<profile>` (NVIDIA's
"mixed" strategy), so the scheduler counts them, the kubelet hands them out, PodResources lists
them, and the container gets NVIDIA_VISIBLE_DEVICES as with NVIDIA's plugin. A GPU shared by
time-slicing is advertised as NVIDIA's plugin does with `renameByDefault`: N replicas
`<UUID>::<n>` under `nvidia.com/gpu.shared`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuusage.api.resources import (
    MIG_RESOURCE_PREFIX,
    REPLICA_SEPARATOR,
    SHARED_GPU_RESOURCE,
    mig_profile,
)
from gpuusage.retry import poll_until
from gpuusage_dev.fakekubelet import GRPC_MODULE, KUBELET_MODULE
from gpuusage_dev.localcluster.binaries import (
    BinariesError,
    Progress,
    ensure_go_program,
    stderr_progress,
)
from gpuusage_dev.localcluster.cluster import stop_child

SOURCE = Path(__file__).with_name("main.go")
KUBELET_REGISTRATION = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
"""Fixed whatever the kubelet's --root-dir says: one node per machine."""


def ensure_device_plugin(progress: Progress = stderr_progress) -> Path:
    return ensure_go_program(
        "gpuusage-device-plugin",
        SOURCE,
        (KUBELET_MODULE, GRPC_MODULE),
        "gpuusage builds its device plugin (the kubelet's device-plugin API) from Go modules once.",
        progress,
    )


def scenario_resources(
    scenario: Mapping[str, Any], time_slicing: Mapping[str, int] | None = None
) -> dict[str, list[str]]:
    """Resource name → device IDs for a GPU scenario: whole GPUs as nvidia.com/gpu, MIG devices
    as nvidia.com/mig-<profile> (a MIG device without a profile in its name is left out); a
    whole GPU `time_slicing` names (UUID → N) as N replicas under nvidia.com/gpu.shared."""
    found: dict[str, list[str]] = {}
    sliced = time_slicing or {}
    for gpu in scenario.get("gpus") or []:
        migs = gpu.get("migDevices")
        if migs is None and gpu["uuid"] in sliced:
            replicas = [f"{gpu['uuid']}{REPLICA_SEPARATOR}{n}" for n in range(sliced[gpu["uuid"]])]
            found.setdefault(SHARED_GPU_RESOURCE, []).extend(replicas)
            continue
        if migs is None:
            found.setdefault("nvidia.com/gpu", []).append(gpu["uuid"])
            continue
        for mig in migs:
            profile = mig_profile(mig.get("name"))
            if profile:
                found.setdefault(f"{MIG_RESOURCE_PREFIX}{profile}", []).append(mig["uuid"])
    return found


class DevicePlugin:
    """The plugin registering `resources` with the kubelet at `kubelet_socket`."""

    def __init__(
        self,
        resources: Mapping[str, list[str]],
        folder: Path,
        *,
        kubelet_socket: Path = KUBELET_REGISTRATION,
        binary: Path | None = None,
    ) -> None:
        self.resources = dict(resources)
        self.folder = folder
        self.kubelet_socket = kubelet_socket
        self.binary = binary or ensure_device_plugin()
        self.registered: set[str] = set()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def registrations(self) -> Path:
        """Where the plugin says "registered <resource>" each time the kubelet accepts it: a
        file, not a pipe, so that it outlives whoever started it (`local-cluster restart`
        exits; a plugin writing to a closed pipe would die at the kubelet's next restart)."""
        return self.folder / "registrations.log"

    def start(
        self, timeout: float = 60.0, on_start: Callable[[int], None] | None = None
    ) -> DevicePlugin:
        """Start it and wait until every resource is registered; `on_start` is told its pid
        at once (to record it before the wait)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        listed = self.folder / "resources.json"
        listed.write_text(json.dumps(self.resources))
        said = self.registrations.stat().st_size if self.registrations.exists() else 0
        with (
            self.registrations.open("ab") as out,
            (self.folder / "device-plugin.log").open("ab") as log,
        ):
            self._process = subprocess.Popen(
                [
                    str(self.binary),
                    "--kubelet-socket",
                    str(self.kubelet_socket),
                    "--resources",
                    str(listed),
                ],
                stdout=out,
                stderr=log,
                start_new_session=True,
            )
        if on_start is not None:
            on_start(self._process.pid)
        if not poll_until(lambda: self._all_registered(said), timeout, 0.1):
            self.stop()
            raise BinariesError(
                f"the device plugin did not register {sorted(self.resources)} with the kubelet "
                f"within {timeout:.0f} s (see {self.folder / 'device-plugin.log'})"
            )
        return self

    def _all_registered(self, since: int) -> bool:
        """Whether every resource was registered since byte `since` of the registrations."""
        with self.registrations.open("rb") as said:
            said.seek(since)
            lines = said.read().decode(errors="replace").splitlines()
        self.registered = {
            line.split(" ", 1)[1].strip() for line in lines if line.startswith("registered ")
        }
        return self.registered >= set(self.resources)

    def stop(self) -> None:
        process, self._process = self._process, None
        stop_child(process)
