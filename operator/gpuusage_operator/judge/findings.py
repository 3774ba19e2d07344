"""A pod's finding: the one rule that names it, for the condition that states it, the policies
that act on it and the OpenReports that publish it. Pure.

The judge decides a pod's use (podstate's Verdict: in use as judged against its allocation, idle,
ended, unknown); `pod_finding` names what of that is a finding, `observe` hands it to the
policies with since when it holds and whether it is certain, and `finding_of` reads it back
from a pod's condition, for what publishes the marks as the pods show them (the OpenReports).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Final, Literal

from gpuusage.api.reasons import PodFinding

if TYPE_CHECKING:
    from gpuusage_operator.judge.allocation import Judgement
    from gpuusage_operator.judge.idle import Idle

REASON_UNREQUESTED: Final[PodFinding] = "UsingUnrequestedGPU"
REASON_UNALLOCATED: Final[PodFinding] = "UsingUnallocatedGPU"
REASON_HELD_IDLE: Final[PodFinding] = "HoldingIdleGPU"
REASON_IDLE: Final[PodFinding] = "RequestedGPUsIdle"
"""Each finding's name is the reason of the pod condition that states it (every reason is
one of gpuusage.api.reasons')."""

UseState = Literal["InUse", "Stopped", "Unknown", "Idle"]

FINDING_OF: dict[tuple[str, str], PodFinding] = {
    ("True", REASON_HELD_IDLE): "HoldingIdleGPU",
    ("True", REASON_UNREQUESTED): "UsingUnrequestedGPU",
    ("True", REASON_UNALLOCATED): "UsingUnallocatedGPU",
    ("False", REASON_IDLE): "RequestedGPUsIdle",
}
"""The pod condition (status, reason) that states each finding."""


def pod_finding(
    state: UseState, judgement: Judgement | None, idle: Idle | None
) -> PodFinding | None:
    """The finding of a pod's use as judged: in use without any allocation, or outside it
    (these come first), holding memory without computing; given GPUs and idle."""
    if state == "InUse" and judgement is not None:
        if judgement.finding == "Unrequested":
            return "UsingUnrequestedGPU"
        if judgement.finding == "Unallocated":
            return "UsingUnallocatedGPU"
        if judgement.held_idle_since is not None:
            return "HoldingIdleGPU"
    if state == "Idle" and idle is not None:
        return "RequestedGPUsIdle"
    return None


@dataclass(frozen=True)
class Observation:
    """A pod's finding as the policies take it."""

    finding: PodFinding | None
    certain: bool
    """False while its use is Unknown (its node's report stale, a device it used blind, a
    container restarting): neither the finding nor its end is known."""
    since: datetime | None = None
    """When the finding began, where the judge knows (holding idle, given GPUs idle)."""


def observe(state: UseState, judgement: Judgement | None, idle: Idle | None) -> Observation:
    """A pod's finding as the judge decided it (its Verdict's state, judgement and idleness),
    since when, and whether it is certain."""
    if state == "Unknown":
        return Observation(None, certain=False)
    found = pod_finding(state, judgement, idle)
    since = None
    if found == "HoldingIdleGPU" and judgement is not None:
        since = judgement.held_idle_since
    elif found == "RequestedGPUsIdle" and idle is not None:
        since = idle.since
    return Observation(found, certain=True, since=since)


def finding_of(condition: Mapping[str, str] | None) -> PodFinding | None:
    """The finding a pod's condition states; None for none (in use as allocated, ended,
    Unknown)."""
    if not condition:
        return None
    return FINDING_OF.get((condition.get("status", ""), condition.get("reason", "")))
