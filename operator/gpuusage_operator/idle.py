"""Which pods requested GPUs and leave them idle? Pure.

A pod that holds `nvidia.com/gpu` (or a MIG resource) keeps the device from everyone else
whether or not it runs anything on it. The operator flags a running pod that requested GPUs
when none of its processes has used a GPU on its node for `--idle-after`.

Since when is a pod idle? The operator keeps no clock of its own (a restarted replica must reach
the same answer), so the time comes from the pod itself:

* our `gpuusage.io/GPUInUse` condition is `False`: since its lastTransitionTime, the moment
  its last use ended (a change of reason, such as becoming idle, keeps that time);
* the condition is `True` (in use until this report) or `Unknown` (the node's report was
  stale, so nothing is known about the meantime): from now on;
* no condition: the pod never used a GPU, so since `status.startTime`.

Only a complete, fresh report can show that nothing runs: when the node's report is stale or
blind anywhere (the GPU library unavailable, a device unreadable, a process not attributable;
see certainty), no pod is judged idle.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuusage.api.models import IdlePod
from gpuusage.api.times import parse_time
from gpuusage_operator.podindex import PodSnapshot

DEFAULT_IDLE_AFTER = timedelta(minutes=30)


@dataclass(frozen=True)
class Idle:
    """A pod judged idle, and since when."""

    pod: PodSnapshot
    since: datetime

    def entry(self) -> IdlePod:
        return IdlePod(
            namespace=self.pod.namespace,
            name=self.pod.name,
            uid=self.pod.uid,
            requested_gpus=self.pod.gpu_requests,
            idle_since=self.since,
        )


def idle_since(pod: PodSnapshot, now: datetime) -> datetime | None:
    """Since when the pod's requested GPUs have seen no use; None when it is no candidate."""
    if pod.gpu_requests <= 0 or not pod.running:
        return None
    condition = pod.our_condition
    if condition is not None and condition.get("status") == "False":
        ended = parse_time(condition.get("lastTransitionTime"))
        if ended is not None:
            return ended
    if condition is not None:
        return now
    return parse_time(pod.started_at)


def idle_pods(
    requesting: Iterable[PodSnapshot],
    in_use: Collection[str],
    now: datetime,
    idle_after: timedelta | None,
) -> list[Idle]:
    """The requesting pods (not among the in_use UIDs) idle for at least idle_after.

    idle_after None turns the check off.
    """
    if idle_after is None:
        return []
    found = []
    for pod in requesting:
        if pod.uid in in_use:
            continue
        since = idle_since(pod, now)
        if since is not None and now - since >= idle_after:
            found.append(Idle(pod, since))
    return found
