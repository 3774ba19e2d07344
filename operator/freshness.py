"""Is a node's report fresh? The pure decision behind the Stale condition.

A report is stale when the agent's latest observation is older than the threshold: the agent
is gone, stuck, or cannot reach the API. The operator then marks the node's pods `Unknown`
rather than pretending their GPU use is current.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from gpuusage.api import names
from gpuusage.api.models import Condition
from gpuusage.api.times import format_time

# Three of the agent's default 60 s heartbeats: one lost write is no reason to call a node stale.
DEFAULT_STALE_AFTER = timedelta(minutes=3)


def is_stale(observed_at: datetime, now: datetime, stale_after: timedelta) -> bool:
    """True when the observation is older than stale_after.

    An observation from the future (clock skew between node and operator) counts as fresh:
    skew is not the agent's absence.
    """
    return now - observed_at > stale_after


def stale_condition(
    observed_at: datetime,
    now: datetime,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
    previous: Condition | None = None,
    generation: int | None = None,
) -> Condition:
    """The Stale condition, keeping lastTransitionTime when the status did not change.

    The message names the observation time, not its age: an age would change on every
    reconcile and turn every reconcile into a status write.
    """
    stale = is_stale(observed_at, now, stale_after)
    status = "True" if stale else "False"
    when = format_time(observed_at)
    limit = int(stale_after.total_seconds())
    if stale:
        reason = "ReportOutdated"
        message = (
            f"no report from the node agent since {when} (threshold {limit}s); "
            "is the node agent running?"
        )
    else:
        reason = "ReportFresh"
        # No time here: every heartbeat would change the message and cost a status write.
        message = f"the node agent reports within the {limit}s threshold"
    transition = (
        previous.last_transition_time
        if previous is not None and previous.status == status
        else now.replace(microsecond=0)
    )
    return Condition(
        type=names.CONDITION_STALE,
        status=status,
        observed_generation=generation,
        last_transition_time=transition,
        reason=reason,
        message=message,
    )
