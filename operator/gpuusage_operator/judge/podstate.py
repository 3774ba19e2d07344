"""What each pod should show about its GPU use, and the smallest patch to get there. Pure.

For every pod with processes on a node's GPUs: the annotations `gpuusage.io/gpus`,
`gpuusage.io/gpu-memory-mib` and `gpuusage.io/usage` (compact JSON, bounded in size with an
explicit truncation marker), and the pod condition `gpuusage.io/GPUInUse`. When use ends the
annotations are removed and the condition turns False; when a pod that requested GPUs has left
them idle long enough its False condition says so (reason RequestedGPUsIdle); when the node's
report is stale, or cannot see a device the pod was using (see certainty), the condition turns
Unknown and the annotations stay (last known use). Patches are computed against what the pod
shows now and are None when nothing would change: an unchanged report costs no pod write and no
Event.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from gpuusage.api import names
from gpuusage.api.reasons import EventReason, InUseReason, PodFinding
from gpuusage.api.summary import share_moved
from gpuusage.api.times import format_time
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.allocation import Judgement
from gpuusage_operator.judge.certainty import BlindSpots, Cause, LastDevices, why_unknown
from gpuusage_operator.judge.findings import (
    REASON_HELD_IDLE,
    REASON_IDLE,
    REASON_UNALLOCATED,
    REASON_UNREQUESTED,
    UseState,
    pod_finding,
)
from gpuusage_operator.judge.idle import Idle
from gpuusage_operator.judge.resolution import PodUse
from gpuusage_operator.judge.restarts import RestartCause, restart_cause, settle_until
from gpuusage_operator.judge.transitions import transition_time

MAX_USAGE_BYTES = 4096
OUR_ANNOTATIONS = (names.ANNOTATION_GPUS, names.ANNOTATION_GPU_MEMORY_MIB, names.ANNOTATION_USAGE)

WARNED_USE: dict[PodFinding, str] = {
    REASON_UNREQUESTED: "GPUs it did not request",
    REASON_UNALLOCATED: "a GPU outside its allocation",
    REASON_HELD_IDLE: "GPU memory without computing",
}
"""In-use reasons that are findings: each gets a Warning Event when it starts."""


def _warned(reason: str | None) -> PodFinding | None:
    """The in-use finding a condition's reason states, if it is one."""
    return next((finding for finding in WARNED_USE if finding == reason), None)


def usage_json(use: PodUse, max_bytes: int = MAX_USAGE_BYTES) -> str:
    """Compact JSON detail per container and device, at most max_bytes.

    Shape: {"node", "observedAt", "containers": [{"name", "devices": [{"uuid", "mib", "pids",
    "share"}]}]}, "share" (the container's share of the device's time, see Process) only where
    the agent measured one. Too large: pids are dropped first, then containers from the end, and
    "truncated": true says so, so that a reader never mistakes a shortened list for the whole.
    """
    per_container: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in sorted(use.resolutions, key=lambda r: (r.container_name or "", r.device_uuid)):
        key = r.container_name or (r.process.container_id or "")[:12] or "?"
        slot = per_container[key].setdefault(
            r.device_uuid, {"uuid": r.device_uuid, "mib": 0, "pids": []}
        )
        slot["mib"] += r.process.used_memory_mib or 0
        slot["pids"].append(r.process.pid)
        if r.process.compute_share is not None:
            slot["share"] = round(slot.get("share", 0.0) + r.process.compute_share, 2)
    containers: list[dict[str, Any]] = [
        {"name": name, "devices": [{**d, "pids": sorted(d["pids"])} for d in devs.values()]}
        for name, devs in per_container.items()
    ]
    doc: dict[str, Any] = {
        "node": use.node,
        "observedAt": format_time(use.observed_at),
        "containers": containers,
        "requestedGPUs": use.pod.gpu_requests,
    }

    def encoded() -> str:
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    text = encoded()
    if len(text) <= max_bytes:
        return text
    doc["truncated"] = True
    for container in containers:
        for device in container["devices"]:
            device.pop("pids", None)
    while len(text := encoded()) > max_bytes and containers:
        containers.pop()
    return text


def desired_annotations(use: PodUse) -> dict[str, str]:
    return {
        names.ANNOTATION_GPUS: ",".join(use.devices),
        names.ANNOTATION_GPU_MEMORY_MIB: str(use.memory_mib),
        names.ANNOTATION_USAGE: usage_json(use),
    }


SHARE_MOVED = 0.1
"""A container's share of a device moving by less than this leaves its annotation as it is."""


def _shares(doc: dict[str, Any]) -> list[float | None]:
    """The document's shares, one per device slot in order, taken out of it."""
    found: list[float | None] = []
    for container in doc.get("containers") or []:
        for device in container.get("devices") or []:
            found.append(device.pop("share", None) if isinstance(device, dict) else None)
    return found


def _same_use(current: str | None, wanted: str | None) -> bool:
    """Usage documents that differ only in observedAt, and in shares by less than a tenth,
    describe the same use.

    Every agent heartbeat carries a new observation time; rewriting every GPU pod for it would
    turn each heartbeat into a pod write. The annotation therefore keeps the time at which the
    use was first observed in its current form. A share the agent republished for a move of a
    few points, or one carried along by another change on the node, must not rewrite the pod
    either: its annotation follows only moves of SHARE_MOVED.
    """
    if current is None or wanted is None:
        return current == wanted
    try:
        old, new = json.loads(current), json.loads(wanted)
    except ValueError:
        return False
    if not isinstance(old, dict) or not isinstance(new, dict):
        return False
    old.pop("observedAt", None)
    new.pop("observedAt", None)
    old_shares, new_shares = _shares(old), _shares(new)
    if old != new or len(old_shares) != len(new_shares):
        return False
    return not any(
        share_moved(a, b, SHARE_MOVED) for a, b in zip(old_shares, new_shares, strict=True)
    )


def annotation_patch(
    current: Mapping[str, str], desired: Mapping[str, str] | None
) -> dict[str, str | None] | None:
    """The metadata.annotations merge patch from current to desired (None: remove ours).

    Returns None when nothing would change.
    """
    patch: dict[str, str | None] = {}
    for key in OUR_ANNOTATIONS:
        want = None if desired is None else desired.get(key)
        have = current.get(key)
        if key == names.ANNOTATION_USAGE and _same_use(have, want):
            continue
        if have != want:
            patch[key] = want
    return patch or None


def _gpu_in_use(status: str, reason: InUseReason, message: str) -> dict[str, str]:
    return {
        "type": names.POD_CONDITION_GPU_IN_USE,
        "status": status,
        "reason": reason,
        "message": message,
    }


def desired_condition(
    state: UseState,
    use: PodUse | None,
    node: str,
    idle: Idle | None = None,
    unknown: Cause | RestartCause | None = None,
    *,
    judgement: Judgement | None = None,
) -> dict[str, str]:
    """The gpuusage.io/GPUInUse condition (without lastTransitionTime) for a state.

    The message names the devices but not the memory: memory changes often, lives in the
    annotations, and putting it here would turn each change into a second pod write. An
    Unknown state says why (`unknown`; without one: the node's report is stale). A pod in
    use is judged against its allocation (`judgement`, the report's; without one it states
    no finding).
    """
    if state == "InUse" and use is not None:
        count = len(use.resolutions)
        message = (
            f"{count} process{'es' if count != 1 else ''} on node {node} "
            f"{'use' if count != 1 else 'uses'} {', '.join(use.devices)}; memory in the "
            f"{names.ANNOTATION_GPU_MEMORY_MIB} annotation"
        )
        found = pod_finding(state, judgement, idle)
        if found == "UsingUnrequestedGPU":
            return _gpu_in_use(
                "True",
                REASON_UNREQUESTED,
                message + "; the pod has no GPU allocation of any kind (no nvidia.com/gpu or "
                "MIG resource, no DRA claim, no scheduler's share), so the scheduler and quotas "
                "do not count this use (NVIDIA_VISIBLE_DEVICES=all?)",
            )
        if found == "UsingUnallocatedGPU" and judgement is not None:
            return _gpu_in_use(
                "True",
                REASON_UNALLOCATED,
                message + f"; {', '.join(judgement.outside)} is outside what the pod was "
                f"allocated ({judgement.allocation.detail}): NVIDIA_VISIBLE_DEVICES overridden, or "
                "a process outside its container's devices?",
            )
        if found == "HoldingIdleGPU":
            return _gpu_in_use(
                "True",
                REASON_HELD_IDLE,
                # no time here: the condition would change with every report (the time is
                # in the report's status.pods[].heldIdleSince)
                message + "; none of them has computed anything for longer than --idle-after "
                "while holding the memory, which no other pod can use (an idle notebook "
                "kernel?)",
            )
        return _gpu_in_use("True", "ProcessesRunning", message)
    if state == "Unknown" and unknown is not None:
        return _gpu_in_use(
            "Unknown",
            unknown.reason,
            f"{unknown.message}; whether the pod "
            "still uses it is unknown, last known use is kept in the "
            "annotations",
        )
    if state == "Unknown":
        return _gpu_in_use(
            "Unknown",
            "NodeReportStale",
            f"the GPU report of node {node} is stale; last known use is kept in the annotations",
        )
    if pod_finding(state, judgement, idle) == "RequestedGPUsIdle" and idle is not None:
        return _gpu_in_use(
            "False",
            REASON_IDLE,
            f"the pod was given {idle.allocation.detail} but none of its processes has used a "
            f"GPU on node {node} since {format_time(idle.since)}; the devices stay reserved "
            "for it and unavailable to other pods",
        )
    return _gpu_in_use(
        "False", "ProcessesEnded", f"no process of this pod uses a GPU on node {node}"
    )


def condition_patch(
    current: Iterable[Mapping[str, Any]], desired: Mapping[str, str], now: datetime
) -> dict[str, Any] | None:
    """The condition to send through a strategic-merge patch of pods/status, or None.

    lastTransitionTime follows transitions.transition_time.
    """
    existing = next((c for c in current if c.get("type") == desired["type"]), None)
    if existing is not None and all(existing.get(k) == v for k, v in desired.items()):
        return None
    transition = transition_time(
        None if existing is None else existing.get("status"),
        None if existing is None else existing.get("lastTransitionTime"),
        desired["status"],
        format_time(now),
    )
    return {**desired, "lastTransitionTime": transition}


@dataclass(frozen=True)
class PodEvent:
    reason: EventReason
    note: str
    type: Literal["Normal", "Warning"] = "Normal"


def event_for(
    previous: Mapping[str, Any] | None, new: Mapping[str, str], resumed: str | None = None
) -> PodEvent | None:
    """The Event to record on a condition change, or None: only transitions, never per cycle.

    Use starting and ending are Normal; starting on a GPU the pod never requested, and
    requested GPUs turning idle, are Warnings (what a person looking at the pod should act on).
    Use seen again after a spell of Unknown went on rather than started: no Event, and no
    second Warning for a finding that is what the pod showed before the spell (`resumed`:
    that reason, where known).
    """
    before = (previous or {}).get("status")
    before_reason = (previous or {}).get("reason")
    finding = _warned(new["reason"])
    if before == "Unknown" and resumed is not None and new["reason"] == resumed:
        return None  # known again as it was before the spell: nothing happened to the pod
    if new["status"] == "True" and before == "Unknown" and finding is None:
        return None  # use seen again after a spell of not knowing: it went on, it did not start
    if new["status"] == "True" and before != "True":
        if finding is not None:
            return PodEvent(finding, f"started using {WARNED_USE[finding]}", "Warning")
        return PodEvent("GPUUseStarted", "started using GPUs")
    if finding is not None and before_reason != new["reason"]:
        return PodEvent(finding, f"uses {WARNED_USE[finding]}", "Warning")
    if new["reason"] == REASON_IDLE and before_reason != REASON_IDLE:
        return PodEvent(REASON_IDLE, "requested GPUs are idle", "Warning")
    if new["status"] == "False" and before in ("True", "Unknown"):
        return PodEvent("GPUUseEnded", "stopped using GPUs")
    return None


@dataclass(frozen=True)
class Verdict:
    """What one pod should show after a report, and why."""

    pod: PodSnapshot
    state: UseState
    use: PodUse | None = None
    idle: Idle | None = None
    unknown: Cause | RestartCause | None = None
    judgement: Judgement | None = None
    settles_until: datetime | None = None
    """Until when the pod's marks stay as they are, though the report shows none of its
    processes (see restarts.settle_until): nothing is written for it, nor acted on, before."""
    absent_since: datetime | None = None
    """While it settles: when a report first showed none of its processes (the reconciler
    keeps it for the next report)."""

    @property
    def wakes(self) -> datetime | None:
        """When this pod's verdict changes with nothing else changing: its marks settled, or
        its restarting container's grace over."""
        if self.settles_until is not None:
            return self.settles_until
        return self.unknown.until if isinstance(self.unknown, RestartCause) else None


def verdicts(
    uses: Mapping[str, PodUse],
    marked: Iterable[PodSnapshot],
    idle: Iterable[Idle],
    *,
    stale: bool,
    blind: BlindSpots,
    judged: Mapping[str, Judgement] | None = None,
    restarts: tuple[datetime, timedelta] | None = None,
    last: LastDevices | None = None,
    absent: Mapping[str, datetime] | None = None,
) -> list[Verdict]:
    """Every pod a report speaks about: the pods it shows using GPUs (Unknown while it is
    stale), the idle ones, and the pods that carry our marks but are no longer listed: use
    ended, unless the report is stale or blind where the pod was (see certainty), or a
    container of it is restarting (given `restarts`: now and the grace; see restarts), which
    keeps them Unknown. `last`: where each pod was last seen (by default its annotation).
    Given `restarts`, a pod whose use ended or whose container is restarting first settles
    (see restarts.settle_until), from when `absent` says an earlier report first showed none
    of its processes (by UID; from now where it says nothing)."""
    judged = judged or {}
    found = [
        Verdict(use.pod, "Unknown" if stale else "InUse", use, judgement=judged.get(uid))
        for uid, use in uses.items()
    ]
    idle = list(idle)
    idle_uids = {i.pod.uid for i in idle}
    for pod in marked:
        if pod.uid in uses or pod.uid in idle_uids:
            continue
        unknown: Cause | RestartCause | None = None
        if not stale:
            unknown = why_unknown(pod, blind, last)
            if unknown is None and restarts is not None:
                unknown = restart_cause(pod, *restarts)
        state: UseState = "Unknown" if stale or unknown else "Stopped"
        found.append(Verdict(pod, state, unknown=unknown))
    found += [Verdict(i.pod, "Idle", idle=i) for i in idle]
    if restarts is None:
        return found
    now = restarts[0]
    return [_settling(verdict, (absent or {}).get(verdict.pod.uid, now), now) for verdict in found]


def _settling(verdict: Verdict, absent_since: datetime, now: datetime) -> Verdict:
    """The verdict, held while the pod's marks settle (see restarts.settle_until)."""
    if verdict.state != "Stopped" and not isinstance(verdict.unknown, RestartCause):
        return verdict
    until = settle_until(verdict.pod, absent_since, now)
    if until is None:
        return verdict
    return replace(verdict, settles_until=until, absent_since=absent_since)


@dataclass(frozen=True)
class PodPlan:
    """The writes that bring a pod to its verdict; None where nothing would change."""

    annotations: dict[str, str]
    """Our annotations once the plan is applied (empty: none)."""
    annotation_patch: dict[str, str | None] | None
    condition: dict[str, str]
    """The condition once the plan is applied (with its lastTransitionTime)."""
    condition_patch: dict[str, Any] | None
    event: PodEvent | None
    """Recorded once the condition patch landed."""
    event_note: str = ""


def plan_pod(
    verdict: Verdict,
    shown_annotations: Mapping[str, str],
    shown_condition: Mapping[str, Any] | None,
    node: str,
    now: datetime,
    *,
    remembered: Mapping[str, Any] | None = None,
    known: Mapping[str, str] | None = None,
    resumed: str | None = None,
) -> PodPlan:
    """From what the pod shows now to what its verdict wants. An Unknown pod keeps the last
    known use in its annotations; an idle pod's condition dates from the start of its
    idleness, so that the time reads back as the same idle_since on the next report.
    `remembered`: the condition the operator last wrote, where someone removed it since: the
    transition is judged from it (no Event for a condition put back as it was) and its
    transition time kept when its status stands. `known`: the annotations the operator last
    wrote on the pod, where it remembers them: an Unknown pod keeps those, not what someone may
    have written over them since. `resumed`: the reason the pod showed before its condition
    turned Unknown, where the operator remembers it (see event_for)."""
    if verdict.state == "InUse" and verdict.use is not None:
        wanted: dict[str, str] = desired_annotations(verdict.use)
    elif verdict.state == "Unknown":
        wanted = dict(shown_annotations if known is None else known)
    else:
        wanted = {}
    condition = desired_condition(
        verdict.state, verdict.use, node, verdict.idle, verdict.unknown, judgement=verdict.judgement
    )
    patch = annotation_patch(shown_annotations, wanted or None)
    since = verdict.idle.since if verdict.idle is not None else now
    cpatch = condition_patch([shown_condition] if shown_condition else [], condition, since)
    previous = shown_condition if remembered is None else remembered
    if cpatch is not None and remembered is not None:
        kept = condition_patch([remembered], condition, since)
        when = (kept or remembered).get("lastTransitionTime") or format_time(since)
        cpatch = {**condition, "lastTransitionTime": when}
    event = event_for(previous, condition, resumed) if cpatch is not None else None
    return PodPlan(
        annotations=wanted,
        annotation_patch=patch,
        condition={**condition, **cpatch} if cpatch else dict(shown_condition or condition),
        condition_patch=cpatch,
        event=event,
        event_note="" if event is None else f"{event.note}: {condition['message']}",
    )


def shows(
    annotations: Mapping[str, str], condition: Mapping[str, str] | None, plan: PodPlan
) -> bool:
    """Whether a pod carrying these marks carries what the plan brings it to: nothing of the
    plan left to write (a usage annotation within its rounding counts as the same)."""
    if annotation_patch(annotations, plan.annotations or None) is not None:
        return False
    return condition is not None and all(condition.get(k) == v for k, v in plan.condition.items())
