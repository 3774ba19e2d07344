"""Is a node's report fresh? The pure decision behind the Stale condition.

A report is stale when the operator has seen no sign of life from its agent for longer than the
threshold (see threshold: the operator's --stale-after where set, else the agent's Lease's own
duration, else three minutes): the agent is gone, stuck, or cannot reach the API. The
operator then marks the node's pods `Unknown` rather than pretending their GPU use is current.

Signs of life are renewals of the agent's Lease (named after the node, in the agent's
namespace; see Renewal) and changes of the report. An agent that renews a Lease writes its
report only when it changed or every few minutes; an agent of an earlier version renews none,
and its report's own rewrites (every heartbeat) are the only sign. The Stale condition says
which one the operator is using.

Freshness is judged by the operator's own clock: when it saw the report's current generation
appear (`Sighting.seen_at`), never by `spec.observedAt`, which the node's clock wrote. The node
lifecycle controller judges kubelet Leases the same way. A report dated in the year 2100 is
therefore fresh only while it keeps changing, and an agent whose clock is far off is said to be
so (the Stale condition's message, and a metric), since its `observedAt` misleads people.

What the operator saw is kept in the report's status (`reportSeenAt` with
`observedGeneration`), so a restarted or newly active replica reaches the same answer: a report
that was already stale stays stale, without a moment of false freshness.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuusage.api import names
from gpuusage.api.models import Condition, GpuNodeUsageStatus
from gpuusage.api.reasons import StaleReason
from gpuusage.api.times import format_time
from gpuusage_operator.judge.transitions import transition_time

# Three of the agent's default 60 s heartbeats: one lost write is no reason to call a node stale.
DEFAULT_STALE_AFTER = timedelta(minutes=3)
# Beyond this, observedAt and the operator's clock disagree by more than a write's delay.
MAX_CLOCK_SKEW = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class Sighting:
    """What the operator knows of a report's changes, by its own clock."""

    generation: int | None
    seen_at: datetime
    """When the operator first saw this generation (or the status says a replica did)."""
    skew: timedelta | None = None
    """observedAt minus seen_at, measured when a new generation was seen as it happened: how
    far the agent's clock is ahead (negative: behind), plus the write's delay."""
    stale: bool = False
    """Staleness as the report's status shows it now (what the staleness watch compares to)."""


def sight(
    previous: Sighting | None,
    generation: int | None,
    observed_at: datetime,
    status: GpuNodeUsageStatus | None,
    now: datetime,
    *,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> Sighting:
    """The sighting after seeing the report at `generation` at `now`.

    A generation already seen keeps its time. A new generation is seen now; it measures the
    skew when the one before was seen recently too (the operator was watching, so the change
    is only a write's delay old). At first sight (operator start, takeover), the status tells
    when a replica saw this generation; without that (a status from an older operator) a
    report that status calls stale stays stale, and any other counts from now on.
    """
    now = now.replace(microsecond=0)  # as the status keeps it, so a re-read gives the same
    if previous is not None:
        if previous.generation == generation:
            return previous
        watching = now - previous.seen_at <= stale_after
        return Sighting(generation, now, observed_at - now if watching else None, previous.stale)
    stale = status.stale if status is not None else False
    if status is not None and status.observed_generation == generation:
        if status.report_seen_at is not None:
            return Sighting(generation, min(status.report_seen_at, now), None, stale)
        if stale:
            return Sighting(generation, min(observed_at, now), None, stale)
    return Sighting(generation, now, None, stale)


@dataclass(frozen=True, slots=True)
class Renewal:
    """What the operator saw of a node agent's Lease, by its own clock."""

    lease: str
    """namespace/name, for messages."""
    seen_at: datetime
    """When the operator first saw the Lease's current renewTime."""
    witnessed: bool
    """A renewal was seen happening, not only the Lease as it was found at the operator's
    start: only that can make a report its status calls stale fresh again."""
    duration: timedelta | None = None
    """The Lease's leaseDurationSeconds: how long the agent vouches for itself per renewal."""


def threshold(stale_after: timedelta | None, renewal: Renewal | None) -> timedelta:
    """How long without a sign of life a node's report may go before it is stale: the
    operator's --stale-after where set; else, for an agent that renews a Lease, the Lease's
    own duration (what the agent vouches for with each renewal); else
    DEFAULT_STALE_AFTER (an agent without a Lease, judged by its report's rewrites)."""
    if stale_after is not None:
        return stale_after
    if renewal is not None and renewal.duration is not None:
        return renewal.duration
    return DEFAULT_STALE_AFTER


def alive_at(sighting: Sighting, renewal: Renewal | None) -> datetime:
    """The last sign of life: the later of the report's last change and its Lease's last
    renewal. A Lease found as it was at start says nothing new of a report already stale."""
    if renewal is None or (not renewal.witnessed and sighting.stale):
        return sighting.seen_at
    return max(sighting.seen_at, renewal.seen_at)


def is_stale(seen_at: datetime, now: datetime, stale_after: timedelta) -> bool:
    """True when the last sign of life is older than stale_after."""
    return now - seen_at > stale_after


@dataclass(frozen=True)
class Freshness:
    """A report's freshness at one moment, worked out once (see freshness): what the Stale
    condition, the judge and the staleness deadline all read."""

    sighting: Sighting
    renewal: Renewal | None
    threshold: timedelta
    alive: datetime
    """The last sign of life (see alive_at)."""
    stale: bool

    @property
    def turns_stale(self) -> datetime:
        """When a fresh report turns stale if no sign of life comes."""
        return self.alive + self.threshold


def freshness(
    sighting: Sighting, renewal: Renewal | None, stale_after: timedelta | None, now: datetime
) -> Freshness:
    """The report's freshness at `now` (`stale_after`: --stale-after, see threshold)."""
    limit = threshold(stale_after, renewal)
    alive = alive_at(sighting, renewal)
    return Freshness(sighting, renewal, limit, alive, is_stale(alive, now, limit))


def skew_text(skew: timedelta | None) -> str | None:
    """How far the agent's clock is off, in words, when that is beyond MAX_CLOCK_SKEW.

    In whole minutes (at least one), so that the message, and with it the status, does not
    change with every report.
    """
    if skew is None or abs(skew) <= MAX_CLOCK_SKEW:
        return None
    minutes = max(1, round(abs(skew).total_seconds() / 60))
    direction = "ahead of" if skew > timedelta(0) else "behind"
    return (
        f"the node agent's clock is about {minutes} minute{'s' if minutes != 1 else ''} "
        f"{direction} the operator's (spec.observedAt is the node's clock; freshness is judged "
        "by the operator's)"
    )


def stale_condition(
    fresh: Freshness,
    now: datetime,
    *,
    previous: Condition | None = None,
    generation: int | None = None,
) -> Condition:
    """The Stale condition, keeping lastTransitionTime when the status did not change.

    The message names when the agent was last seen alive, not how long ago: an age would
    change on every reconcile and turn every reconcile into a status write. It says what
    liveness is judged by (the Lease, or the report's rewrites).
    """
    alive, stale, renewal, sighting = fresh.alive, fresh.stale, fresh.renewal, fresh.sighting
    status = "True" if stale else "False"
    limit = int(fresh.threshold.total_seconds())
    reason: StaleReason
    if stale:
        reason = "ReportOutdated"
        sign = (
            f"no renewal of Lease {renewal.lease} and no change of the report"
            if renewal is not None
            else "no report from the node agent"
        )
        message = (
            f"{sign} since {format_time(alive)} by the operator's clock (threshold {limit}s); "
            "is the node agent running?"
        )
    elif renewal is not None:
        reason = names.STALE_REASON_LEASE
        # No time here: every renewal would change the message and cost a status write.
        message = f"the node agent renews Lease {renewal.lease} within the {limit}s threshold"
    else:
        reason = "ReportFresh"
        message = (
            f"the node agent reports within the {limit}s threshold (it renews no Lease: an "
            "agent of an earlier version, or one without a Lease namespace, so its report's "
            "own rewrites show it alive)"
        )
    skewed = skew_text(sighting.skew)
    if skewed:
        message += f"; {skewed}"
    transition = transition_time(
        None if previous is None else previous.status,
        None if previous is None else previous.last_transition_time,
        status,
        now.replace(microsecond=0),
    )
    return Condition(
        type=names.CONDITION_STALE,
        status=status,
        observed_generation=generation,
        last_transition_time=transition,
        reason=reason,
        message=message,
    )
