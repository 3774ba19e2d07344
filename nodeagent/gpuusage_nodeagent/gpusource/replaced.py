"""Was the driver replaced, under this process, by one of another version? Pure but for the
state it keeps.

The NVIDIA container runtime mounts the driver's user-space libraries (libnvidia-ml.so.<version>)
into the agent's container when the container is created, and pynvml loads the library once per
process: nvmlShutdown and a later nvmlInit keep it. When the driver comes back after an upgrade
with another version, the process holds the old driver's library over the new kernel module, and
the kernel refuses it: nvmlInit fails with NVML_ERROR_LIB_RM_VERSION_MISMATCH for as long as
that module stays loaded. Only a new container, which the runtime gives the new driver's
libraries, can read the GPUs again; so the agent ends, with a message and a non-zero status, and
the kubelet re-creates its container (the DaemonSet's restartPolicy is Always).

The rule: a LibRmVersionMismatch in a reading of a source that read a driver before (in this
process) ends the agent. No second reading is waited for: the kernel compares the library's
version with its own, an answer that stands while the module stays loaded, and a new container
reads whatever module is loaded then. A source that never read a driver idles and says why
instead (a mismatch from its start is not mended by a restart: see gpusource.nvml).
"""

from __future__ import annotations

from gpuusage_nodeagent.gpusource.base import Reading

MISMATCH = "LibRmVersionMismatch"
"""NVML's error (NVML_ERROR_LIB_RM_VERSION_MISMATCH) by its name in a reading's errors."""


class DriverReplaced(Exception):
    """The driver under this process's NVML library was replaced by one of another version."""

    def __init__(self, version: str | None, detail: str | None) -> None:
        loaded = f"driver {version}" if version else "the driver it first read"
        super().__init__(
            f"the NVIDIA driver was replaced by one of another version ({detail or MISMATCH}): "
            f"this process's NVML library is {loaded}'s, which the new kernel module refuses; "
            "the agent exits so that its container is created again with the new driver's "
            "libraries"
        )


class LoadedLibrary:
    """The driver version this process's library last read, and the rule above."""

    def __init__(self) -> None:
        self.worked = False
        self.version: str | None = None

    def check(self, reading: Reading) -> None:
        """Raise DriverReplaced where `reading` shows the rule's case."""
        source = reading.source
        if source.available:
            self.worked = True
            self.version = source.driver_version or self.version
        elif self.worked and reading.errors.get(MISMATCH):
            raise DriverReplaced(self.version, source.message)
