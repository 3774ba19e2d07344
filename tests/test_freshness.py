"""The Stale condition's pure decision."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuusage.operator.freshness import is_stale, stale_condition

OBSERVED = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
LIMIT = timedelta(seconds=120)


def test_fresh_until_the_threshold_then_stale() -> None:
    assert not is_stale(OBSERVED, OBSERVED + LIMIT, LIMIT)
    assert is_stale(OBSERVED, OBSERVED + LIMIT + timedelta(seconds=1), LIMIT)


def test_future_observations_count_as_fresh() -> None:
    assert not is_stale(OBSERVED, OBSERVED - timedelta(minutes=5), LIMIT)


def test_condition_reads_well_and_keeps_transition_time() -> None:
    fresh = stale_condition(OBSERVED, OBSERVED + timedelta(seconds=5), LIMIT)
    assert (fresh.type, fresh.status, fresh.reason) == ("Stale", "False", "ReportFresh")
    assert fresh.message == "the node agent reports within the 120s threshold"

    later = OBSERVED + timedelta(seconds=30)
    still = stale_condition(OBSERVED, later, LIMIT, previous=fresh)
    assert still.last_transition_time == fresh.last_transition_time

    much_later = OBSERVED + timedelta(minutes=3, seconds=7)
    stale = stale_condition(OBSERVED, much_later, LIMIT, previous=still, generation=4)
    assert (stale.status, stale.reason) == ("True", "ReportOutdated")
    assert stale.last_transition_time == much_later
    assert "no report from the node agent since 2026-11-21T12:00:00Z (threshold 120s)" in (
        stale.message
    )
    again = stale_condition(
        OBSERVED, much_later + timedelta(seconds=9), LIMIT, previous=stale, generation=4
    )
    assert again == (stale), (
        "an unchanged situation yields an identical condition (no status write)"
    )
    assert stale.observed_generation == 4
