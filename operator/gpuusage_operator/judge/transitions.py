"""When a condition last transitioned. Pure.

metav1.Condition's rule, for every condition gpuusage writes (the report's Ready and Stale, the
pods' GPUInUse): `lastTransitionTime` moves only when the status changes; a new reason or
message alone is an update without a transition.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def transition_time(old_status: str | None, old_time: T | None, new_status: str, now: T) -> T:
    """The lastTransitionTime of a condition going from old_status to new_status at `now`."""
    return old_time if old_time is not None and old_status == new_status else now
