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
(see gpusource.nvml), and ends the agent too once that has lasted MISMATCH_LASTING: a container
created while the node's libraries were still the old driver's (the agent restarted before the
runtime's were replaced) is mended by the next one, and a node whose libraries never match shows
it as restarts, the kubelet's back-off spacing them.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from gpuusage_nodeagent.gpusource.base import Reading

MISMATCH_LASTING = timedelta(minutes=5)
"""How long a mismatch from the start is idled through before the agent ends."""
MISMATCH = "LibRmVersionMismatch"
"""NVML's error (NVML_ERROR_LIB_RM_VERSION_MISMATCH) by its name in a reading's errors."""


class DriverReplaced(Exception):
    """The driver under this process's NVML library was replaced by one of another version."""

    def __init__(
        self, version: str | None, detail: str | None, *, since_start: bool = False
    ) -> None:
        if since_start:
            super().__init__(
                f"the NVIDIA kernel module has refused this process's NVML library since it "
                f"started, for {MISMATCH_LASTING} ({detail or MISMATCH}): the agent exits so "
                "that its container is created again with the node's current libraries"
            )
            return
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
        self._refused_since: datetime | None = None

    def check(self, reading: Reading, now: datetime) -> None:
        """Raise DriverReplaced where `reading` (read at `now`) shows the rule's case."""
        source = reading.source
        if source.available:
            self.worked = True
            self.version = source.driver_version or self.version
            self._refused_since = None
        elif reading.errors.get(MISMATCH):
            if self.worked:
                raise DriverReplaced(self.version, source.message)
            self._refused_since = self._refused_since or now
            if now - self._refused_since >= MISMATCH_LASTING:
                raise DriverReplaced(None, source.message, since_start=True)
        else:
            self._refused_since = None
