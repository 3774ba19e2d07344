"""How many enforced actions policies may take: per policy and across the cluster, per hour.
Pure.

A rule that is wrong (a selector wider than meant, an `after` too short) should cost a few
workloads, not a cluster's: each policy takes at most its `maxActionsPerHour` actions that
change something (Notify changes nothing and is not counted) in any sliding hour, and all
policies together at most the operator's --policy-cluster-actions-per-hour. An action over
either limit waits until the oldest action in the window is an hour old.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta

WINDOW = timedelta(hours=1)
CLUSTER_ACTIONS_PER_HOUR = 30
COUNTED = frozenset({"ScaleToZero", "Suspend", "DeletePod", "Evict", "Taint"})
"""The actions that change a workload or a node (and so count against the limits)."""


def recent(times: Iterable[datetime], now: datetime) -> list[datetime]:
    """The times within the window ending now, oldest first (and any after now: another
    worker's, whose reconcile began later, or another replica's with its clock ahead)."""
    return sorted(t for t in times if now - WINDOW < t)


def next_allowed(
    policy: str,
    acted: Mapping[str, Sequence[datetime]],
    *,
    per_policy: int,
    cluster: int,
    now: datetime,
) -> datetime | None:
    """None when `policy` may act now; else the earliest time either limit allows it."""
    mine = recent(acted.get(policy, ()), now)
    if len(mine) >= per_policy:
        return mine[len(mine) - per_policy] + WINDOW
    everyone = recent((t for times in acted.values() for t in times), now)
    if len(everyone) >= cluster:
        return everyone[len(everyone) - cluster] + WINDOW
    return None
