"""What each pod should show about its GPU use: its verdict and the marks that state it. Pure.

For every pod with processes on a node's GPUs: the annotations `gpuusage.io/gpus`,
`gpuusage.io/gpu-memory-mib` and `gpuusage.io/usage` (compact JSON, bounded in size with an
explicit truncation marker), and the pod condition `gpuusage.io/GPUInUse`. When use ends the
annotations are removed and the condition turns False; when a pod that requested GPUs has left
them idle long enough its False condition says so (reason RequestedGPUsIdle); when the node's
report is stale, or cannot see a device the pod was using (see certainty), the condition turns
Unknown and the annotations stay (last known use). The writers diff these marks against what
the pod shows (see writers.marks).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api import names
from gpuusage.api.reasons import InUseReason
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

MAX_USAGE_BYTES = 4096


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


@dataclass(frozen=True)
class WantedMarks:
    """What a pod should carry after a report, as the judge wants it: what the writers diff
    against the pod (see writers.marks)."""

    annotations: dict[str, str] | None
    """Our annotations (empty: none); None: the last known use stays (an Unknown pod)."""
    condition: dict[str, str]
    """The GPUInUse condition, without its lastTransitionTime."""
    since: datetime | None = None
    """When the condition's state began, where that is before the report (an idle pod: the
    start of its idleness); None: the moment it is written."""


def mark_of(verdict: Verdict, node: str) -> WantedMarks:
    """The marks a verdict wants a pod on `node` to carry."""
    if verdict.state == "InUse" and verdict.use is not None:
        annotations: dict[str, str] | None = desired_annotations(verdict.use)
    elif verdict.state == "Unknown":
        annotations = None
    else:
        annotations = {}
    condition = desired_condition(
        verdict.state, verdict.use, node, verdict.idle, verdict.unknown, judgement=verdict.judgement
    )
    return WantedMarks(annotations, condition, verdict.idle.since if verdict.idle else None)


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
    marks: WantedMarks | None = None
    """What the pod should carry (see mark_of): every verdict of verdicts() has them."""

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
    pod_judgements: Mapping[str, Judgement] | None = None,
    restarts: tuple[datetime, timedelta] | None = None,
    last: LastDevices | None = None,
    absent: Mapping[str, datetime] | None = None,
    node: str = "",
) -> list[Verdict]:
    """Every pod a report speaks about: the pods it shows using GPUs (Unknown while it is
    stale), the idle ones, and the pods that carry our marks but are no longer listed: use
    ended, unless the report is stale or blind where the pod was (see certainty), or a
    container of it is restarting (given `restarts`: now and the grace; see restarts), which
    keeps them Unknown. `last`: where each pod was last seen (by default its annotation).
    Given `restarts`, a pod whose use ended or whose container is restarting first settles
    (see restarts.settle_until), from when `absent` says an earlier report first showed none
    of its processes (by UID; from now where it says nothing). Each verdict carries its marks
    (see mark_of), for a pod on `node` (by default the pod's own node)."""
    pod_judgements = pod_judgements or {}
    found = [
        Verdict(use.pod, "Unknown" if stale else "InUse", use, judgement=pod_judgements.get(uid))
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
    found = [replace(v, marks=mark_of(v, node or v.pod.node or "")) for v in found]
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
