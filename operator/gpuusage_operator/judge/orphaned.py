"""GPU memory that no live pod holds. Pure.

Memory held by the processes of a pod that is gone (its container outlived it, a zombie the
runtime lost), of a container no pod has, or of no container at all keeps the next pod off the
GPU's memory while the scheduler believes the GPU free. Only reasons that say "no pod" count:
NVIDIA's own daemons hold memory for their clients, and a process the agent could not
attribute may well be a pod's.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from gpuusage.api.models import OrphanedMemory
from gpuusage_operator.judge.resolution import Resolution

ORPHAN_REASONS = frozenset({"PodNotFound", "UnknownContainer", "HostProcess"})


def orphaned_memory(
    resolutions: Iterable[Resolution], previous: OrphanedMemory | None, now: datetime
) -> OrphanedMemory | None:
    """The node's orphaned memory now (None: none); `since` carries on from the previous
    status while some stayed held, and starts now when it comes back after none."""
    held = [r for r in resolutions if r.pod is None and r.reason in ORPHAN_REASONS]
    memory = sum(r.process.used_memory_mib or 0 for r in held)
    if memory == 0:
        return None
    since = previous.since if previous is not None and previous.since is not None else None
    return OrphanedMemory(
        memory_mib=memory,
        processes=len({(r.process.pid, r.device_uuid) for r in held}),
        since=since or now.replace(microsecond=0),
    )
