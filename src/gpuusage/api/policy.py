"""The GpuUsagePolicy API as pydantic models: what a platform team asks gpuusage to do about
what it sees. The source of the CRD's schema (see crd.render_policy_crd), as models.py is for
GpuNodeUsage.

A policy selects pods (a namespace selector and a pod selector, as a NetworkPolicy does) and
says, finding by finding, what to do once the finding has held for `after`: only tell
(`Notify`), or act (scale the owner to zero, suspend the Job, delete an ownerless pod, evict).
Every rule is a dry run unless it says `Enforce`. Which actions fit which finding is part of
the schema (CEL), so that a policy that could never work is refused at `kubectl apply`, with a
message naming the field.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from gpuusage.api.models import ApiModel, Namespace
from gpuusage.api.reasons import PodFinding

IDLE_FINDINGS = ("HoldingIdleGPU", "RequestedGPUsIdle")
MISUSE_FINDINGS = ("UsingUnrequestedGPU", "UsingUnallocatedGPU")
IDLE_ACTIONS = ("Notify", "ScaleToZero", "Suspend", "DeletePod")
MISUSE_ACTIONS = ("Notify", "Evict")
NODE_ACTIONS = ("Notify", "Taint")

PodAction = Literal["Notify", "ScaleToZero", "Suspend", "DeletePod", "Evict"]
NodeFinding = Literal["OrphanedGPUMemory"]
NodeAction = Literal["Notify", "Taint"]
Mode = Literal["DryRun", "Enforce"]
PodOptOut = Literal["Allowed", "Ignored"]

DURATION_PATTERN = r"^([0-9]{1,6}h)?([0-9]{1,6}m)?([0-9]{1,6}s)?$"
_DURATION = re.compile(r"^(?:(\d{1,6})h)?(?:(\d{1,6})m)?(?:(\d{1,6})s)?$")
MAX_RULES = 8
MAX_NODE_RULES = 2
MAX_DECISIONS = 50
MAX_SELECTOR_ENTRIES = 16
MAX_ACTIONS_PER_HOUR = 1000

Duration = Annotated[str, Field(pattern=DURATION_PATTERN, min_length=2, max_length=24)]
"""Hours, minutes and seconds as kubectl writes them: 90s, 30m, 2h, 1h30m."""
LabelKey = Annotated[str, Field(min_length=1, max_length=317)]
LabelValue = Annotated[str, Field(max_length=63)]


def parse_duration(text: str) -> timedelta:
    """`1h30m` → 90 minutes; a ValueError for anything the schema would refuse."""
    found = _DURATION.match(text)
    if not text or found is None or not any(found.groups()):
        raise ValueError(f"not a duration (such as 90s, 30m, 2h, 1h30m): {text!r}")
    hours, minutes, seconds = (int(g) if g else 0 for g in found.groups())
    return timedelta(hours=hours, minutes=minutes, seconds=seconds)


def _quoted(words: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{w}'" for w in words) + "]"


class SelectorRequirement(ApiModel):
    """One expression of a label selector, as Kubernetes writes it."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.operator in ['In', 'NotIn'] ? "
                    "(has(self.values) && size(self.values) > 0) : "
                    "(!has(self.values) || size(self.values) == 0)",
                    "message": "values: required for In and NotIn, empty for Exists and "
                    "DoesNotExist",
                }
            ]
        }
    )

    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: Annotated[list[LabelValue], Field(max_length=MAX_SELECTOR_ENTRIES)] = Field(
        default_factory=list
    )
    """Required for In and NotIn, empty for Exists and DoesNotExist."""


class LabelSelector(ApiModel):
    """Labels an object must carry; an empty selector selects everything."""

    match_labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_SELECTOR_ENTRIES)] = (
        Field(default_factory=dict)
    )
    match_expressions: Annotated[
        list[SelectorRequirement], Field(max_length=MAX_SELECTOR_ENTRIES)
    ] = Field(default_factory=list)


class PodRule(ApiModel):
    """What to do about pods with one finding, once it has held for `after`."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.finding in {_quoted(IDLE_FINDINGS)} ? "
                    f"self.action in {_quoted(IDLE_ACTIONS)} : "
                    f"self.action in {_quoted(MISUSE_ACTIONS)}",
                    "message": "action: HoldingIdleGPU and RequestedGPUsIdle take Notify, "
                    "ScaleToZero, Suspend or DeletePod; UsingUnrequestedGPU and "
                    "UsingUnallocatedGPU take Notify or Evict",
                }
            ]
        }
    )

    finding: PodFinding
    """HoldingIdleGPU and RequestedGPUsIdle: GPUs held idle; UsingUnrequestedGPU and
    UsingUnallocatedGPU: GPUs used without being given."""
    after: Duration = "0s"
    """How long the finding must hold before the action (on top of the operator's own
    --idle-after for the idle findings): the pod's owner is warned when the finding starts."""
    action: PodAction
    """Notify (an Event and an annotation only); for idle findings ScaleToZero (the pod's
    controlling workload through its scale subresource), Suspend (a batch Job), DeletePod (a pod
    no controller owns); for misuse Evict (the Eviction API: PodDisruptionBudgets hold)."""
    mode: Mode = "DryRun"
    """DryRun records what the action would do and does nothing; Enforce does it."""


class NodeRule(ApiModel):
    """What to do about a node whose GPUs hold memory of processes of no live pod."""

    finding: NodeFinding
    after: Duration = "10m"
    """How long the orphaned memory must stay before the action."""
    min_memory_mib: Annotated[int, Field(ge=1, le=16 * 1024 * 1024)] = Field(
        default=1024, alias="minMemoryMiB"
    )
    """Orphaned memory on the node below this is not acted upon (bookkeeping, jitter)."""
    action: NodeAction
    """Notify (the Node condition gpuusage.io/OrphanedGPUMemory), or Taint (also the NoSchedule
    taint gpuusage.io/OrphanedGPUMemory, removed when the memory is freed)."""
    mode: Mode = "DryRun"


class GpuUsagePolicySpec(ApiModel):
    """Which pods, and what to do about each finding."""

    namespace_selector: LabelSelector | None = None
    """Namespaces whose pods the policy covers; absent: all namespaces."""
    pod_selector: LabelSelector | None = None
    """Pods the policy covers within them; absent: all pods."""
    rules: Annotated[list[PodRule], Field(max_length=MAX_RULES)] = Field(default_factory=list)
    """Pod findings, at most one rule per finding."""
    node_rules: Annotated[list[NodeRule], Field(max_length=MAX_NODE_RULES)] = Field(
        default_factory=list
    )
    """Node findings, at most one rule per finding."""
    max_actions_per_hour: Annotated[int, Field(ge=1, le=MAX_ACTIONS_PER_HOUR)] = 10
    """Enforced actions that change something (all but Notify) this policy takes in any
    sliding hour; beyond it an action waits (outcome RateLimited). The operator's
    --policy-cluster-actions-per-hour caps all policies together."""
    pod_opt_out: PodOptOut = "Allowed"
    """Whether a pod's own gpuusage.io/exempt annotation takes it out of this policy (Allowed)
    or counts for nothing (Ignored). Whoever may edit a pod may write the annotation, so a
    policy against misuse that a tenant must not escape says Ignored; a namespace's annotation
    (which tenants seldom may write) counts either way."""


class Target(ApiModel):
    """What a decision is about."""

    kind: Literal["Pod", "Node"]
    namespace: Namespace | None = None
    name: Annotated[str, Field(min_length=1, max_length=253)]
    uid: Annotated[str, Field(max_length=64)] | None = None


class Decision(ApiModel):
    """One thing the policy decided, newest first in the status."""

    target: Target
    finding: Annotated[str, Field(pattern=r"^[A-Za-z]+$", max_length=64)]
    action: Annotated[str, Field(pattern=r"^[A-Za-z]+$", max_length=32)]
    mode: Mode
    decided_at: datetime
    due_at: datetime | None = None
    """When the action was or is to be taken (the finding's start plus `after`)."""
    done: bool = False
    """True once an enforced action was carried out."""
    outcome: Annotated[str, Field(pattern=r"^[A-Za-z]*$", max_length=64)] = ""
    """Why it stands as it does, as a reason word: Pending, Done, DryRun, Cancelled,
    Refused (a PodDisruptionBudget), RateLimited, NotPermitted, NotApplicable,
    ManagedElsewhere (a GitOps tool or an autoscaler would undo the action)."""


class GpuUsagePolicyStatus(ApiModel):
    """What the operator made of the policy."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    mode: Literal["DryRun", "Enforce", "Mixed"] | None = None
    """DryRun when no rule enforces, Enforce when every rule does, else Mixed."""
    rules: Annotated[str, Field(max_length=256)] = ""
    """The rules in one line (finding>action), for `kubectl get gpuusagepolicy`."""
    actions_taken: Annotated[int, Field(ge=0)] = 0
    """Enforced actions carried out since the policy was created."""
    decisions: Annotated[list[Decision], Field(max_length=MAX_DECISIONS)] = Field(
        default_factory=list
    )
    """The latest decisions, newest first."""
    acted_at: Annotated[list[datetime], Field(max_length=MAX_ACTIONS_PER_HOUR)] = Field(
        default_factory=list
    )
    """When the enforced actions of the last hour were taken, each written just before it was
    (what the rate limits count, kept here so that a restarted replica or the next leader
    counts them too)."""
