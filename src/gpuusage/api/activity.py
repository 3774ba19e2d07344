"""What a published process does on its device's engines, read from the agent's report. Pure.

One copy for the operator (whether a pod computes on a device) and the people's commands
(`gpuusage ps`), so the two never tell the same process differently.
"""

from __future__ import annotations

from typing import Literal

from gpuusage.api.models import Process

Activity = Literal["computing", "idle", "unknown"]


def process_activity(process: Process) -> Activity:
    """`unknown` where the device does not tell or the samples cannot vouch for it yet
    (activityUnknown), `idle` once it has used no engine for the agent's --idle-window
    (idleSince), else `computing`: it used an engine within that window."""
    if process.activity_unknown:
        return "unknown"
    return "idle" if process.idle_since is not None else "computing"
