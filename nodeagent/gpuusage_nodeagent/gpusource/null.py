"""The source for a node without a GPU library."""

from __future__ import annotations

from collections.abc import Collection

from gpuusage import __version__
from gpuusage.api.models import Source
from gpuusage_nodeagent.gpusource.base import Reading


class NullSource:
    """No GPU library on this node: idle, and say so in every report."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def read(self) -> Reading:
        source = Source(
            kind="none", available=False, message=self.reason, agent_version=__version__
        )
        return Reading(source, [])

    def poll(self) -> None:
        """No sampler to read."""

    def sample_shares(self, devices: Collection[str], span: float) -> None:
        """No sampler to read."""

    def close(self) -> None:
        """Nothing to release."""
