"""Which pods were given GPUs and leave them idle? Pure.

A pod that holds `nvidia.com/gpu` (or a MIG resource), a DRA claim's GPUs or a scheduler's share
keeps them from everyone else whether or not it runs anything on them. The operator flags a
running pod with any GPU allocation (see allocation) when none of its processes has used a GPU
on its node for `--idle-after`. A pod whose claims cannot be read is no candidate.

Since when is a pod idle? The operator keeps no clock of its own (a restarted replica must reach
the same answer), so the time comes from the pod itself:

* our `gpuusage.io/GPUInUse` condition is `False`: since its lastTransitionTime, the moment
  its last use ended (a change of reason, such as becoming idle, keeps that time);
* the condition is `True` (in use until this report) or `Unknown` (the node's report was
  stale, so nothing is known about the meantime): from now on;
* no condition: the pod never used a GPU, so since `status.startTime`.

Only a fresh report that sees a pod's devices can show that nothing runs on them: when the
node's report is stale, no pod is judged idle; a device the report is blind on (the GPU library
unavailable, the device unreadable, a process on it not attributable; see certainty) withholds
the judgement of the pods that could be using it, never of the whole node (see judge.report).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuusage.api.models import IdlePod
from gpuusage.api.times import parse_time
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.allocation import Allocation

DEFAULT_IDLE_AFTER = timedelta(minutes=30)


@dataclass(frozen=True)
class Idle:
    """A pod judged idle, and since when."""

    pod: PodSnapshot
    since: datetime
    allocation: Allocation

    def entry(self) -> IdlePod:
        return IdlePod(
            namespace=self.pod.namespace,
            name=self.pod.name,
            uid=self.pod.uid,
            requested_gpus=self.pod.gpu_requests
            + sum(d.from_claim for d in self.allocation.devices),
            idle_since=self.since,
        )


Allocated = Callable[[PodSnapshot], Allocation]
"""What a pod was handed, by the report's one rule (judge.report: the settings' rules, the
claims, the kubelet's view), worked out once per report."""


def idle_since(pod: PodSnapshot, now: datetime) -> datetime | None:
    """Since when the pod's GPUs have seen no use; None when it does not run."""
    if not pod.running:
        return None
    condition = pod.our_condition
    if condition is not None and condition.get("status") == "False":
        ended = parse_time(condition.get("lastTransitionTime"))
        if ended is not None:
            return ended
    if condition is not None:
        return now
    return parse_time(pod.started_at)


def next_idle_deadline(
    candidates: Iterable[PodSnapshot],
    in_use: Collection[str],
    now: datetime,
    idle_after: timedelta | None,
) -> datetime | None:
    """When the next of the candidates not judged idle yet would be, if nothing changes: the
    operator must look again then, since a report that does not change sends no event."""
    if idle_after is None:
        return None
    due = [
        since + idle_after
        for pod in candidates
        if pod.uid not in in_use
        for since in [idle_since(pod, now)]
        if since is not None and now - since < idle_after
    ]
    return min(due, default=None)


def idle_pods(
    candidates: Iterable[PodSnapshot],
    in_use: Collection[str],
    now: datetime,
    idle_after: timedelta | None,
    allocated: Allocated,
) -> list[Idle]:
    """The candidates (not among the in_use UIDs) with a GPU allocation, idle for at least
    idle_after. idle_after None turns the check off."""
    if idle_after is None:
        return []
    found = []
    for pod in candidates:
        if pod.uid in in_use:
            continue
        since = idle_since(pod, now)
        if since is None or now - since < idle_after:
            continue
        allocation = allocated(pod)
        if allocation.sources:
            found.append(Idle(pod, since, allocation))
    return found
