"""Since when has each process computed nothing? Pure, with the clock passed in.

Per-process SM utilization comes every cycle and is noise to a report: a process busy in
bursts, or between two epochs, must not turn idle and active again every cycle, and no write may
follow from a percentage alone. So the agent publishes one thing per process, its `idleSince`:
set once the process has used none of the device's engines (SMs, memory controller, encoder,
decoder) for a whole `window` (to the moment its quiet began), and cleared the first cycle it
works again. The report changes only at those transitions.

Where the device does not report per-process utilization (MIG devices, some GPUs, a failed
query, MPS clients) nothing is known: the process is never idle, and its quiet time starts over.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

Key = tuple[str, int]
"""(device UUID, pid)."""

DEFAULT_WINDOW = timedelta(minutes=5)


class ActivityTracker:
    """Remembers, per process on a device, since when it has been quiet."""

    def __init__(self, window: timedelta = DEFAULT_WINDOW) -> None:
        self.window = window
        self._quiet_since: dict[Key, datetime] = {}

    def idle_since(self, key: Key, active: bool | None, now: datetime) -> datetime | None:
        """This cycle's answer for one process: since when it is idle, or None (active,
        quiet for less than the window, or not known)."""
        if not active and active is not None:
            since = self._quiet_since.setdefault(key, now)
            return since if now - since >= self.window else None
        self._quiet_since.pop(key, None)
        return None

    def forget_except(self, seen: Iterable[Key]) -> None:
        """Drop processes no longer listed (a pid reused later starts afresh)."""
        keep = set(seen)
        for key in [k for k in self._quiet_since if k not in keep]:
            del self._quiet_since[key]
