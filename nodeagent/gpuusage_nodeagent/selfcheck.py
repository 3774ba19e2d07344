"""What the agent cannot see because of how it was started, said in the report. Pure, with the
facts gathered once at start (gather).

Two setups look like "nothing runs" from the outside and are not:

* The agent outside the host's pid namespace (the host's /proc mounted, no hostPID). The
  proprietary kernel modules give NVML host pids whatever the caller's namespace; the open GPU
  kernel modules (NVIDIA's default for Turing and newer since R560) translate pids into the
  caller's namespace and drop those it cannot see, so NVML lists nothing of the pods. The
  devices then show memory no listed process holds (see visibility); the report also says why.
* No NVML in the container: the NVIDIA container runtime injects the driver's library and
  device nodes only when it handles the container (its runtime class where it is not the
  default: k3s, RKE2, containerd without nvidia as default runtime) and the container asks for
  devices (NVIDIA_VISIBLE_DEVICES, or CDI devices in CDI mode). What is missing tells which.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuusage import procfs
from gpuusage.api.models import MAX_MESSAGE, Source, safe_text

_NO_LIBRARY = ("LibraryNotFound", "FunctionNotFound")
_NO_DRIVER = ("DriverNotLoaded", "LibRmVersionMismatch", "NoPermission")


@dataclass(frozen=True)
class Setup:
    """What the agent found about its own container at start."""

    proc_root: Path
    own_pid_namespace: bool | None = None
    """Whether the proc root shows the agent's own pid namespace (None: cannot tell)."""
    device_nodes: bool = False
    """Whether /dev/nvidiactl is in the container."""
    visible_devices: str | None = None
    """NVIDIA_VISIBLE_DEVICES as the container has it."""


def gather(
    proc_root: Path, env: Mapping[str, str] | None = None, dev: Path = Path("/dev")
) -> Setup:
    """The facts, read once: whether the proc root shows the agent's own pid namespace, the
    driver's control device, the runtime's variable."""
    env = os.environ if env is None else env
    return Setup(
        proc_root=proc_root,
        own_pid_namespace=procfs.own_pid_namespace(proc_root),
        device_nodes=(dev / "nvidiactl").exists(),
        visible_devices=env.get("NVIDIA_VISIBLE_DEVICES"),
    )


def pid_namespace_note(setup: Setup) -> str | None:
    """Why processes may be missing, when the agent is not in the pid namespace of the
    processes it reads."""
    if setup.own_pid_namespace is not False:
        return None
    return (
        f"the agent is not in the pid namespace of {setup.proc_root} (no hostPID): with the "
        "open GPU kernel modules (default since R560) NVML lists no process of other pid "
        "namespaces, so pods' processes are not seen; run the agent with hostPID"
    )


def nvml_note(setup: Setup, errors: Mapping[str, int]) -> str | None:
    """Why NVML cannot be reached, from the initialisation's error and the container's
    facts; None when it was reached or the error says nothing more."""
    if any(e in errors for e in _NO_LIBRARY):
        if not setup.device_nodes:
            runtime = (
                "NVIDIA_VISIBLE_DEVICES is not set"
                if setup.visible_devices is None
                else "the NVIDIA container runtime did not handle this container"
            )
            return (
                f"no NVIDIA driver library and no /dev/nvidiactl in the agent's container: "
                f"{runtime}; where nvidia is not the default runtime (k3s, RKE2, some "
                "containerd setups) give the agent runtimeClassName nvidia "
                "(agent.runtimeClassName, overlays/runtime-class); in CDI mode, the runtime "
                "class or a cdi.k8s.io annotation naming nvidia.com/gpu=all"
            )
        return (
            "the NVIDIA device nodes are there but not the driver library (libnvidia-ml.so.1): "
            "a CDI spec or runtime hook that mounts devices without the driver's libraries?"
        )
    if any(e in errors for e in _NO_DRIVER):
        return "the NVIDIA kernel driver is not loaded on this node, or does not match its library"
    return None


def with_notes(source: Source, notes: list[str | None]) -> Source:
    """The source with the notes appended to its message."""
    said = [n for n in notes if n]
    if not said:
        return source
    message = "; ".join([*([source.message] if source.message else []), *said])
    return source.model_copy(update={"message": safe_text(message, MAX_MESSAGE)})
