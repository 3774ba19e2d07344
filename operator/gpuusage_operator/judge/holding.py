"""Which pods hold GPU memory and compute nothing? Pure.

The larger waste than a pod that requested GPUs and runs nothing on them is one whose processes
hold the memory and compute nothing: a notebook kernel keeping 70 GiB after its last cell. The
agent publishes, per process, since when it has used none of the device's engines (SMs, memory
controller, encoder, decoder: a transcoding pod works on NVENC/NVDEC alone) as `idleSince`,
after its own --idle-window, by the node's clock; absent while it works, and where per-process
utilization is not reported (MIG devices, MPS clients). A pod is flagged when every one of its
processes, on every device, is idle, has been for the operator's --idle-after, and holds memory.

By whose clock? `idleSince` is the node's, and so is `observedAt`: their difference is how long
the pod had been idle when the report was taken, whatever the node's clock is off by. What
passed since is measured on the operator's clock from when it saw that report (`seen_at`), so a
node's skewed clock can neither hasten nor delay the finding.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from gpuusage.api.activity import process_activity
from gpuusage.api.models import Process
from gpuusage_operator.judge.resolution import PodUse


def held_idle_since(use: PodUse, seen_at: datetime) -> datetime | None:
    """Since when, by the operator's clock, every process of the pod has been idle; None
    while any of them works or is not known to be idle, or while the pod holds no memory that
    is known (a pod holding 0 MiB keeps nothing from anyone)."""
    sinces = [r.process.idle_since for r in use.resolutions]
    if not sinces or any(s is None for s in sinces) or use.memory_mib == 0:
        return None
    latest = max(s for s in sinces if s is not None)  # the pod idles since its last one went
    since = seen_at - max(use.observed_at - latest, timedelta(0))
    return since.replace(microsecond=0)  # whole seconds: the status does not move with jitter


def computing(processes: Iterable[Process]) -> bool | None:
    """Whether a pod computes on one device, from its processes there: True when one whose
    activity the device tells has not been idle for the agent's --idle-window, False when all
    such have, None when the device tells of none (MIG devices, MPS clients, some GPUs): GPU
    time counted as computing is never a guess."""
    told = [a for a in map(process_activity, processes) if a != "unknown"]
    if not told:
        return None
    return "computing" in told


def held_idle(
    uses: Iterable[PodUse], seen_at: datetime, now: datetime, idle_after: timedelta | None
) -> dict[str, datetime]:
    """The pods (by UID) idle-but-holding for at least idle_after, since when; None turns the
    check off."""
    if idle_after is None:
        return {}
    found = {}
    for use in uses:
        since = held_idle_since(use, seen_at)
        if since is not None and now - since >= idle_after:
            found[use.pod.uid] = since
    return found


def next_held_deadline(
    uses: Iterable[PodUse], seen_at: datetime, now: datetime, idle_after: timedelta | None
) -> datetime | None:
    """When the next pod whose processes are idle but not for idle_after yet would be flagged,
    if nothing changes (see idle.next_idle_deadline)."""
    if idle_after is None:
        return None
    due = [
        since + idle_after
        for use in uses
        for since in [held_idle_since(use, seen_at)]
        if since is not None and now - since < idle_after
    ]
    return min(due, default=None)
