"""Every reason gpuusage writes, in one place: a finding's name, the reasons of the pod
condition `gpuusage.io/GPUInUse` and of a report's conditions, and the reasons of its Events.

The judge, the writers and the policies write only these (each a Literal, so a reason made up
anywhere else fails the type check), the CRD schemas take their enums from them (the findings
a policy may name, a device's blind reason, an unattributed process's reason), and
tests/test_docs.py fails where the README or docs/ leave one out.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

PodFinding = Literal[
    "HoldingIdleGPU", "RequestedGPUsIdle", "UsingUnrequestedGPU", "UsingUnallocatedGPU"
]
"""What the operator flags about a pod: each is the reason of the pod condition that states it
and of the Warning Event that announces it, and what a GpuUsagePolicy's rule names."""

SourceReason = Literal["DriverUpgrade"]
"""Why a node agent reads no GPU on purpose (a report's spec.source.reason): DriverUpgrade,
the GPU Operator is replacing the node's driver and the agent let go of it."""

BlindReason = Literal[
    "DeviceNotReadable",
    "ProcessesNotVisible",
    "ProcessesUnresolved",
    "ProcessesOmitted",
    SourceReason,
]
"""Why a device cannot be seen whole; the pod condition reason of the pods last seen on it."""

RestartReason = Literal["ContainerRestarted"]
"""A pod's use is Unknown while its GPU container restarts."""

InUseReason = Literal[
    PodFinding,
    BlindReason,
    RestartReason,
    "ProcessesRunning",
    "ProcessesEnded",
    "NodeReportStale",
]
"""The reasons of the pod condition `gpuusage.io/GPUInUse`."""

UnattributedReason = Literal[
    "HostProcess",
    "UnknownContainer",
    "PodNotFound",
    "PodOnOtherNode",
    "Unresolved",
    "DriverProcess",
]
"""Why a process on a GPU belongs to no known pod (a report's status.unattributed)."""

StaleReason = Literal["ReportOutdated", "LeaseRenewed", "ReportFresh"]
"""The reasons of a report's Stale condition: stale, or fresh by which sign of life."""

ReadyReason = Literal["Reconciled", "ReportStale"]
"""The reasons of a report's Ready condition."""

PolicyOutcome = Literal[
    "Pending",
    "DryRun",
    "Done",
    "Refused",
    "RateLimited",
    "NotPermitted",
    "NotApplicable",
    "ManagedElsewhere",
    "Cancelled",
    "Cleared",
]
"""What became of a policy's decision (status.decisions[].outcome, the decisions metric)."""

PolicyEventReason = Literal[
    "GPUPolicyPending",
    "GPUPolicyNotice",
    "GPUPolicyDryRun",
    "GPUPolicyActed",
    "GPUPolicyRefused",
    "GPUPolicyRateLimited",
    "GPUPolicyNotPermitted",
    "GPUPolicyNotApplicable",
    "GPUPolicyManagedElsewhere",
    "GPUPolicyCancelled",
    "GPUPolicyCleared",
]
"""The reasons of the policies' Events: one per outcome, and the notice before an action."""

EventReason = Literal[PodFinding, PolicyEventReason, "GPUUseStarted", "GPUUseEnded"]
"""The reasons of every Event the operator records."""

_POLICY_EVENT: Final[dict[str, PolicyEventReason]] = {
    "Pending": "GPUPolicyPending",
    "DryRun": "GPUPolicyDryRun",
    "Done": "GPUPolicyActed",
    "Refused": "GPUPolicyRefused",
    "RateLimited": "GPUPolicyRateLimited",
    "NotPermitted": "GPUPolicyNotPermitted",
    "NotApplicable": "GPUPolicyNotApplicable",
    "ManagedElsewhere": "GPUPolicyManagedElsewhere",
    "Cancelled": "GPUPolicyCancelled",
    "Cleared": "GPUPolicyCleared",
}


def policy_event_reason(outcome: PolicyOutcome) -> PolicyEventReason:
    """The reason of the Event that tells a policy's outcome (an action done: GPUPolicyActed)."""
    return _POLICY_EVENT[outcome]


def members(*literals: object) -> tuple[str, ...]:
    """The strings of Literal types (nested ones flattened), in order, once each."""
    found: list[str] = []
    for literal in literals:
        for arg in get_args(literal):
            for value in members(arg) if get_args(arg) else (arg,):
                if isinstance(value, str) and value not in found:
                    found.append(value)
    return tuple(found)


EVERY_REASON: Final = members(
    InUseReason, UnattributedReason, StaleReason, ReadyReason, EventReason
)
"""Every reason gpuusage writes on a condition, an Event or a report's status."""
