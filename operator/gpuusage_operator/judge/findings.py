"""Which finding a pod's GPUInUse condition states. Pure.

The findings are decided once, by podstate, and written into the pod's condition; everything
that acts on them or publishes them (the policies, the OpenReports) reads them back from the
condition through `finding_of`, so that the pod, the policies and the reports never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuusage.api.policy import PodFinding
from gpuusage_operator.judge.podstate import (
    REASON_HELD_IDLE,
    REASON_IDLE,
    REASON_UNALLOCATED,
    REASON_UNREQUESTED,
)

FINDING_OF: dict[tuple[str, str], PodFinding] = {
    ("True", REASON_HELD_IDLE): "HoldingIdleGPU",
    ("True", REASON_UNREQUESTED): "UsingUnrequestedGPU",
    ("True", REASON_UNALLOCATED): "UsingUnallocatedGPU",
    ("False", REASON_IDLE): "RequestedGPUsIdle",
}
"""The pod condition (status, reason) that states each finding."""


def finding_of(condition: Mapping[str, str] | None) -> PodFinding | None:
    """The finding the condition states; None for none (in use as allocated, ended, Unknown)."""
    if not condition:
        return None
    key = (condition.get("status", ""), condition.get("reason", ""))
    return FINDING_OF.get(key)
