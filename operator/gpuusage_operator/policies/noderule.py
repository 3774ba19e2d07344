"""What a policy's node rule does about a node's orphaned GPU memory. Pure.

The marks are ours alone: the Node condition gpuusage.io/OrphanedGPUMemory and, for a `Taint`
rule, the NoSchedule taint of the same key. They are set only when an enforced rule's memory
threshold has been exceeded for its `after`, on a report that is fresh and sees every device;
they are cleared as soon as such a report shows the memory freed (below the threshold), the
rule gone, softened or turned to DryRun. Clearing is always safe (it only lets the scheduler
use the node again as it did before), so it takes no rule and no rate limit; setting the taint
counts against them. An uncertain report changes nothing: not knowing is neither the memory
held nor freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from gpuusage.api.models import OrphanedMemory
from gpuusage.api.policy import NodeRule, parse_duration

NodeStepKind = Literal["Nothing", "Wait", "Mark", "Record", "Clear"]


@dataclass(frozen=True)
class NodeMarks:
    """Our marks as the Node carries them."""

    condition: bool = False
    """Our condition is there with status True."""
    tainted: bool = False


@dataclass(frozen=True)
class NodeStep:
    kind: NodeStepKind
    wanted: NodeMarks
    """The marks the node should carry after the step."""
    until: datetime | None = None
    """For Wait: when the rule's duration is up."""


def node_step(
    rule: NodeRule | None,
    orphaned: OrphanedMemory | None,
    marks: NodeMarks,
    *,
    certain: bool,
    now: datetime,
) -> NodeStep:
    """The one step about the node now (`rule`: the covering policy's OrphanedGPUMemory rule,
    None when no policy has one)."""
    if not certain:
        return NodeStep("Nothing", marks)
    over = (
        rule is not None
        and orphaned is not None
        and orphaned.since is not None
        and orphaned.memory_mib >= rule.min_memory_mib
    )
    if rule is None or orphaned is None or orphaned.since is None or not over:
        return _cleared(marks)
    enforced = rule.mode == "Enforce"
    taints = enforced and rule.action == "Taint"
    if not taints and marks.tainted:  # the rule was softened: the taint goes at once
        return NodeStep("Clear", NodeMarks(condition=marks.condition and enforced))
    due = orphaned.since + parse_duration(rule.after)
    if now < due:
        return NodeStep("Wait", marks, until=due)
    if not enforced:
        return NodeStep("Record", NodeMarks()) if not marks.condition else _cleared(marks)
    wanted = NodeMarks(condition=True, tainted=taints)
    return NodeStep("Nothing" if wanted == marks else "Mark", wanted)


def due_of(rule: NodeRule | None, orphaned: OrphanedMemory | None) -> datetime | None:
    """When the rule acts on this stretch of orphaned memory."""
    if rule is None or orphaned is None or orphaned.since is None:
        return None
    return orphaned.since + parse_duration(rule.after)


def _cleared(marks: NodeMarks) -> NodeStep:
    return NodeStep("Clear" if marks != NodeMarks() else "Nothing", NodeMarks())
