"""When is a new observation worth a write? Pure.

The rule, chosen so that a steady node costs one write per heartbeat and nothing in between:

* Any change in *what* is on the node is meaningful: GPUs and MIG devices, their errors, the
  set of processes, any process's container, pod, name or types, the source (driver, NVML
  availability).
* Memory is meaningful only when it moved by at least `memory_threshold_mib` compared with the
  *last published* report (not the last observation), per process and per device. A process
  that grows slowly therefore still gets published once the drift adds up, while allocator
  jitter of a few MiB never causes a write.
* Utilization percentages are never a reason to write by themselves: they change every second.
  They are refreshed with every write, and at least once per heartbeat.
* The heartbeat (a write even without change) keeps `observedAt` fresh, which is how the
  operator tells a live agent from a dead one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api.models import GpuNodeUsageSpec

# Fields that change every reading and are refreshed by writes made for other reasons.
VOLATILE = frozenset({"observedAt", "utilization", "smUtilPercent", "memoryUtilPercent"})
# Fields compared with a tolerance.
MEMORY = frozenset({"usedMiB", "usedMemoryMiB"})


@dataclass(frozen=True)
class Decision:
    write: bool
    reason: str


def _differs(old: Any, new: Any, threshold: int, key: str = "") -> bool:
    if key in MEMORY and isinstance(old, int) and isinstance(new, int):
        return abs(old - new) >= threshold
    if isinstance(old, dict) and isinstance(new, dict):
        keys = (old.keys() | new.keys()) - VOLATILE
        return any(_differs(old.get(k), new.get(k), threshold, k) for k in keys)
    if isinstance(old, list) and isinstance(new, list):
        return len(old) != len(new) or any(
            _differs(a, b, threshold, key) for a, b in zip(old, new, strict=True)
        )
    return bool(old != new)


def meaningful_change(old: GpuNodeUsageSpec, new: GpuNodeUsageSpec, threshold_mib: int) -> bool:
    """True when new differs from old by more than volatile fields and memory jitter."""
    return _differs(old.to_api(), new.to_api(), threshold_mib)


def decide(
    published: GpuNodeUsageSpec | None,
    published_at: datetime | None,
    new: GpuNodeUsageSpec,
    now: datetime,
    *,
    heartbeat: timedelta,
    threshold_mib: int,
) -> Decision:
    """Whether to write `new`, given what was last published and when."""
    if published is None or published_at is None:
        return Decision(True, "first report")
    if meaningful_change(published, new, threshold_mib):
        return Decision(True, "changed")
    if now - published_at >= heartbeat:
        return Decision(True, "heartbeat")
    return Decision(False, "unchanged")
