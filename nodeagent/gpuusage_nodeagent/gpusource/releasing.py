"""A source that lets go of the driver while the node's driver is being replaced (or its GPUs
reconfigured: see driverupgrade).

While `upgrading()` names a cause (a Node label, `label=value`), the source under it is closed
(NVML: nvmlShutdown, which releases every handle and closes the device files it opened) and
every reading says so: no GPUs, `available` false, reason DriverUpgrade (the API's one reason for
letting go of the driver on purpose; the message names the label, `paused-for-mig-change` for a
MIG change), so the operator makes the pods' use Unknown, never ended. Once it names none, the
next reading is the source's own, which initialises NVML again: a driver of the version the
process's library was loaded for is read in the same process; one of another version is the
end of this process (see gpusource.replaced).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Literal

from gpuusage import __version__
from gpuusage.api.models import MAX_MESSAGE, Source, safe_text
from gpuusage_nodeagent.gpusource.base import GpuSource, Reading

log = logging.getLogger(__name__)


class ReleasingSource:
    """GpuSource over `source` that closes it while `upgrading()` returns a state."""

    def __init__(
        self,
        source: GpuSource,
        kind: Literal["nvml", "fake"],
        upgrading: Callable[[], str | None],
    ) -> None:
        self.source = source
        self.kind: Literal["nvml", "fake"] = kind
        self._upgrading = upgrading
        self.released: str | None = None
        """What the driver was let go for (`label=value`); None while the source reads."""

    def _release(self, state: str) -> None:
        if self.released is None:
            self.source.close()
            log.warning(
                "the Node says %s: NVML shut down, no GPU device file held until it is over",
                state,
            )
        self.released = state

    def read(self) -> Reading:
        state = self._upgrading()
        if state is None:
            if self.released is not None:
                log.info("the Node no longer says %s: reading the GPUs", self.released)
                self.released = None
            return self.source.read()
        self._release(state)
        message = (
            f"the GPU Operator is replacing the driver or resetting the GPUs ({state}): NVML "
            "shut down and no device file held until it is over"
        )
        source = Source(
            kind=self.kind,
            available=False,
            reason="DriverUpgrade",
            message=safe_text(message, MAX_MESSAGE),
            agent_version=__version__,
        )
        return Reading(source, [])

    def poll(self) -> None:
        """Between two readings: let go at once where the Node now says so (a driver manager
        may try its unload seconds after its label), else read the samplers."""
        state = self._upgrading()
        if state is not None:
            self._release(state)
        elif self.released is None:
            self.source.poll()

    def sample_shares(self, devices: Collection[str], span: float) -> None:
        if self.released is None:
            self.source.sample_shares(devices, span)

    def close(self) -> None:
        self.source.close()
