"""A container restart is not the end of a pod's GPU use. Pure.

When the kubelet restarts a container (a crash, a failed liveness probe, an OOM kill), its
process leaves the GPU and the new container's process arrives on it seconds later, under a new
container ID. Read report by report, that is use ended and use started again: an Event pair per
restart, and a condition whose transition time says the use began at the last restart. Two
rules keep the use continuous without ever claiming a process that is not there for long:

* **Settle.** A running pod marked in use whose processes a report no longer shows keeps its
  marks for SETTLE before anything is written: the agent can see the process go before the
  kubelet has reported the container's exit to the API (its status lags the runtime by a
  second or two), and a container restarted at once is back within it. A new process within
  SETTLE changes nothing at all, not even the condition's transition time.
* **Restarting.** After SETTLE, a pod one of whose GPU containers exited less than the grace
  ago (--restart-grace, RESTART_GRACE by default), and which the kubelet restarts (see
  index.pods.container_exits), is `Unknown` with reason ContainerRestarted: its use resumes,
  without an Event, once the new process is listed; if none is by then, its use ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuusage.api import names
from gpuusage.api.reasons import RestartReason
from gpuusage.api.times import format_time, parse_time
from gpuusage_operator.index.pods import PodSnapshot

SETTLE = timedelta(seconds=5)
RESTART_GRACE = timedelta(seconds=60)
REASON_RESTARTED: RestartReason = "ContainerRestarted"


@dataclass(frozen=True)
class RestartCause:
    """Why a pod's use is Unknown while its container restarts."""

    reason: RestartReason
    message: str
    until: datetime
    """When the restart stops explaining the absence: use ended, unless seen again."""


def in_use(pod: PodSnapshot) -> bool:
    """Whether the pod's condition says it is using GPUs, or may be (Unknown)."""
    condition = pod.our_condition
    return condition is not None and condition.get("status") in ("True", "Unknown")


def gpu_containers(pod: PodSnapshot) -> set[str] | None:
    """The containers the usage annotation last named (None: not known, any counts)."""
    try:
        usage = json.loads(pod.our_annotations.get(names.ANNOTATION_USAGE, ""))
        named = {str(c["name"]) for c in usage["containers"]}
    except (ValueError, KeyError, TypeError):
        return None
    return named or None


def restart_cause(
    pod: PodSnapshot, now: datetime, grace: timedelta = RESTART_GRACE
) -> RestartCause | None:
    """Why the pod's missing processes may be a restart in progress (an exit less than `grace`
    ago), or None."""
    if not pod.running or not in_use(pod):
        return None
    wanted = gpu_containers(pod)
    latest: tuple[datetime, str] | None = None
    for name, finished in pod.exits:
        when = parse_time(finished)
        if when is None or (wanted is not None and name not in wanted):
            continue
        if latest is None or when > latest[0]:
            latest = (when, name)
    if latest is None or now >= latest[0] + grace:
        return None
    exited, name = latest
    return RestartCause(
        REASON_RESTARTED,
        f"container {name} exited at {format_time(exited)} and the kubelet restarts it; "
        f"its GPU use goes on once its new process is listed, or counts as ended "
        f"{int(grace.total_seconds())} s after the exit",
        exited + grace,
    )


def settle_until(pod: PodSnapshot, absent_since: datetime, now: datetime) -> datetime | None:
    """Until when a running pod marked in use keeps its marks although this report shows none
    of its processes (first seen missing at `absent_since`); None once that has passed, or for
    a pod that is not running or not marked in use."""
    condition = pod.our_condition
    if not pod.running or condition is None or condition.get("status") != "True":
        return None
    until = absent_since + SETTLE
    return until if now < until else None
