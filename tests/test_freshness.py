"""The Stale condition's pure decision: the operator's clock, never the agent's."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gpuusage.api import names
from gpuusage.api.models import Condition, GpuNodeUsageStatus
from gpuusage.api.times import format_time
from gpuusage_operator.judge.freshness import (
    DEFAULT_STALE_AFTER,
    Renewal,
    Sighting,
    alive_at,
    freshness,
    is_stale,
    sight,
    stale_condition,
    threshold,
)

OBSERVED = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
LIMIT = timedelta(seconds=120)


def condition_at(
    seen: Sighting,
    now: datetime,
    *,
    previous: Condition | None = None,
    generation: int | None = None,
    renewal: Renewal | None = None,
) -> Condition:
    """The Stale condition of a report seen so, at `now`, with a threshold of LIMIT."""
    fresh = freshness(seen, renewal, LIMIT, now)
    return stale_condition(fresh, now, previous=previous, generation=generation)


SECOND = timedelta(seconds=1)


def test_fresh_until_the_threshold_then_stale() -> None:
    assert not is_stale(OBSERVED, OBSERVED + LIMIT, LIMIT)
    assert is_stale(OBSERVED, OBSERVED + LIMIT + SECOND, LIMIT)


def test_a_report_dated_in_the_future_goes_stale_when_it_stops_changing() -> None:
    """observedAt in 2100 is the agent's clock: the report is fresh while it changes, and
    stale once the operator has not seen it change for the threshold."""
    future = datetime(2100, 1, 1, tzinfo=UTC)
    first = sight(None, 1, future, None, OBSERVED, stale_after=LIMIT)
    assert first.seen_at == OBSERVED
    assert not is_stale(first.seen_at, OBSERVED + LIMIT, LIMIT)
    again = sight(first, 1, future, None, OBSERVED + LIMIT, stale_after=LIMIT)
    assert again is first, "an unchanged generation keeps its time"
    assert is_stale(again.seen_at, OBSERVED + LIMIT + SECOND, LIMIT)
    changed = sight(first, 2, future, None, OBSERVED + 10 * SECOND, stale_after=LIMIT)
    assert changed.seen_at == OBSERVED + 10 * SECOND
    assert changed.skew is not None
    assert changed.skew > timedelta(days=365 * 70)
    condition = condition_at(changed, OBSERVED + 11 * SECOND)
    assert condition.status == "False"
    assert "clock is about" in condition.message
    assert "ahead of the operator's" in condition.message


def test_skew_is_measured_only_on_changes_seen_as_they_happen() -> None:
    behind = OBSERVED - timedelta(minutes=10)
    first = sight(None, 1, behind, None, OBSERVED, stale_after=LIMIT)
    assert first.skew is None, "at first sight the report may simply be old"
    live = sight(first, 2, behind + 30 * SECOND, None, OBSERVED + 30 * SECOND, stale_after=LIMIT)
    assert live.skew == -timedelta(minutes=10)
    text = condition_at(live, OBSERVED + 31 * SECOND).message
    assert "about 10 minutes behind the operator's" in text
    late = sight(
        live, 3, OBSERVED, None, OBSERVED + 30 * SECOND + LIMIT + SECOND, stale_after=LIMIT
    )
    assert late.skew is None, "after a pause the change may be old: no skew claimed"
    close = sight(live, 3, OBSERVED + 40 * SECOND, None, OBSERVED + 41 * SECOND, stale_after=LIMIT)
    assert close.skew == -SECOND
    assert "clock" not in condition_at(close, OBSERVED + 42 * SECOND).message


def _status(generation: int, seen: datetime | None, stale: bool) -> GpuNodeUsageStatus:
    condition = Condition(
        type=names.CONDITION_STALE,
        status="True" if stale else "False",
        last_transition_time=OBSERVED,
        reason="X",
    )
    return GpuNodeUsageStatus(
        observed_generation=generation, report_seen_at=seen, conditions=[condition]
    )


def test_a_new_replica_reads_when_the_report_was_seen_from_its_status() -> None:
    now = OBSERVED + timedelta(hours=1)
    seen = OBSERVED + timedelta(minutes=5)
    kept = sight(None, 7, OBSERVED, _status(7, seen, stale=True), now, stale_after=LIMIT)
    assert (kept.seen_at, kept.stale) == (seen, True)
    assert is_stale(kept.seen_at, now, LIMIT), "a dead agent stays stale across a restart"
    newer = sight(None, 8, OBSERVED, _status(7, seen, stale=True), now, stale_after=LIMIT)
    assert newer.seen_at == now, "a generation the status has not seen is seen now"
    # A status of an older operator (no reportSeenAt): stale stays stale, fresh counts from now.
    old_stale = sight(None, 7, OBSERVED, _status(7, None, stale=True), now, stale_after=LIMIT)
    assert is_stale(old_stale.seen_at, now, LIMIT)
    old_fresh = sight(None, 7, OBSERVED, _status(7, None, stale=False), now, stale_after=LIMIT)
    assert old_fresh.seen_at == now


def test_condition_reads_well_and_keeps_transition_time() -> None:
    seen = Sighting(4, OBSERVED)
    fresh = condition_at(seen, OBSERVED + timedelta(seconds=5))
    assert (fresh.type, fresh.status, fresh.reason) == ("Stale", "False", "ReportFresh")
    assert fresh.message.startswith("the node agent reports within the 120s threshold")
    assert "renews no Lease" in fresh.message, "says what liveness is judged by"

    later = OBSERVED + timedelta(seconds=30)
    still = condition_at(seen, later, previous=fresh)
    assert still.last_transition_time == fresh.last_transition_time

    much_later = OBSERVED + timedelta(minutes=3, seconds=7)
    stale = condition_at(seen, much_later, previous=still, generation=4)
    assert (stale.status, stale.reason) == ("True", "ReportOutdated")
    assert stale.last_transition_time == much_later
    assert "no report from the node agent since 2026-11-21T12:00:00Z by the operator's clock" in (
        stale.message
    )
    again = condition_at(seen, much_later + 9 * SECOND, previous=stale, generation=4)
    assert again == stale, "an unchanged situation yields an identical condition (no status write)"
    assert stale.observed_generation == 4


LEASE = "gpuusage-system/n1"


def test_lease_renewals_keep_a_report_fresh_that_does_not_change() -> None:
    """The report was last written at T; the Lease was seen renewed since. Fresh while the
    renewals go on, stale once they stop, by when the operator saw them (its own clock)."""
    seen = Sighting(4, OBSERVED)
    renewed = Renewal(LEASE, OBSERVED + timedelta(minutes=4), witnessed=True)
    later = OBSERVED + timedelta(minutes=5)
    assert alive_at(seen, renewed) == renewed.seen_at
    fresh = condition_at(seen, later, renewal=renewed)
    assert (fresh.status, fresh.reason) == ("False", "LeaseRenewed")
    assert fresh.message == f"the node agent renews Lease {LEASE} within the 120s threshold"
    assert not is_stale(alive_at(seen, renewed), later, LIMIT)
    stopped = renewed.seen_at + LIMIT + SECOND
    stale = condition_at(seen, stopped, renewal=renewed)
    assert (stale.status, stale.reason) == ("True", "ReportOutdated")
    assert f"no renewal of Lease {LEASE} and no change of the report since" in stale.message
    assert format_time(renewed.seen_at) in stale.message


def test_a_lease_found_at_start_does_not_revive_a_report_already_stale() -> None:
    """A restarted operator finds each Lease as it is: for a report its status calls stale,
    only a renewal seen happening counts; for any other, the Lease counts from now."""
    now = OBSERVED + timedelta(hours=1)
    found = Renewal(LEASE, now, witnessed=False)
    stale = Sighting(4, OBSERVED, stale=True)
    assert alive_at(stale, found) == OBSERVED
    assert alive_at(stale, replace(found, witnessed=True)) == now
    assert alive_at(Sighting(4, OBSERVED, stale=False), found) == now
    assert alive_at(stale, None) == OBSERVED, "no Lease: the report alone"


def test_the_threshold_is_the_setting_else_the_leases_duration_else_three_minutes() -> None:
    leased = Renewal("ns/n", OBSERVED, True, timedelta(seconds=40))
    assert threshold(timedelta(seconds=90), leased) == timedelta(seconds=90)
    assert threshold(None, leased) == timedelta(seconds=40)
    assert threshold(None, Renewal("ns/n", OBSERVED, True)) == DEFAULT_STALE_AFTER
    assert threshold(None, None) == DEFAULT_STALE_AFTER
