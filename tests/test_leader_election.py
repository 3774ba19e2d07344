"""Leader election by a Lease (ha.election, pure; ha.leader's gate and elector; ha.fence),
with a fake steady clock and an in-memory Lease that refuses a write on an old version, as
the apiserver does."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from gpuusage.kube.errors import Conflict, NotLeading
from gpuusage.settings import SettingsError
from gpuusage_operator.ha.election import Election, LeaseRecord, Timing, TimingError
from gpuusage_operator.ha.fence import fence_writes
from gpuusage_operator.ha.leader import ActiveGate, LeaseElector, lease_namespace
from gpuusage_operator.ha.terms import Terms
from tests.builders import resolved_operator

TIMING = Timing(lease_duration=15, renew_deadline=10, retry_period=2)
WALL = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)


class Clock:
    """A steady clock the test moves; the wall clock follows it (or not, to show skew)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return WALL + timedelta(seconds=self.now)


class Store:
    """One Lease as the apiserver keeps it: every write names the version it read."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0

    def get(self) -> LeaseRecord | None:
        return self.record

    def write(self, record: LeaseRecord) -> LeaseRecord:
        current = self.record.version if self.record else ""
        if record.version != current:
            raise Conflict("the object has been modified", 409)
        self.version += 1
        self.record = replace(record, version=str(self.version))
        return self.record


def attempt(election: Election, store: Store, clock: Clock) -> bool:
    """One try of the elector's loop, without its thread: whether it wrote."""
    sent = clock()
    wanted = election.claim(store.get(), clock.wall())
    if wanted is None:
        return False
    try:
        written = store.write(wanted)
    except Conflict:
        return False
    election.won(sent, written)
    return True


def test_the_durations_must_shrink_from_lease_to_renew_deadline_to_retry() -> None:
    with pytest.raises(TimingError, match=r"renew deadline .* shorter than the lease"):
        Timing(lease_duration=10, renew_deadline=10, retry_period=2)
    with pytest.raises(TimingError, match=r"retry period .* shorter than the renew deadline"):
        Timing(lease_duration=15, renew_deadline=2, retry_period=2)
    with pytest.raises(TimingError, match="positive"):
        Timing(lease_duration=15, renew_deadline=10, retry_period=0)
    assert Timing() == TIMING, "client-go's defaults"


def test_the_operators_flags_refuse_durations_in_the_wrong_order() -> None:
    with pytest.raises(SettingsError, match=r"--leader-elect-renew-deadline: .*shorter than"):
        resolved_operator(
            "--leader-elect-lease-duration", "6", "--leader-elect-renew-deadline", "8"
        )
    with pytest.raises(SettingsError, match=r"--leader-elect-retry-period: .*shorter than"):
        resolved_operator("--leader-elect-renew-deadline", "4", "--leader-elect-retry-period", "4")
    settings = resolved_operator()
    assert settings.leader_timing() == TIMING
    assert settings.deprecated_flags() == []


def test_the_peering_flags_are_accepted_ignored_and_named_with_their_replacement() -> None:
    settings = resolved_operator(
        "--peering", "gpuusage", "--priority", "7", "--peering-lifetime", "30"
    )
    said = "\n".join(settings.deprecated_flags())
    assert "--peering is ignored" in said
    assert "--leader-elect-resource-name" in said
    assert "--priority is ignored" in said
    assert "--peering-lifetime is ignored" in said
    assert "--leader-elect-lease-duration" in said


def test_the_first_replica_creates_the_lease_and_leads() -> None:
    clock, store = Clock(), Store()
    me = Election("a", TIMING, clock)
    assert not me.leading()
    assert attempt(me, store, clock)
    assert me.leading()
    assert me.term == 1
    assert store.record is not None
    assert (store.record.holder, store.record.duration, store.record.transitions) == ("a", 15, 0)


def test_a_replica_seen_leading_is_seen_in_its_new_term() -> None:
    """Another thread may ask at any moment: once `leading()` says yes, the term has already
    moved on, so the gate runs the new term's start (forget, judge again) before any write."""

    class Watched(Election):
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)
            if name == "_renewed_at" and value is not None:
                seen.append((self.leading(), self.term))

    seen: list[tuple[bool, int]] = []
    clock, store = Clock(), Store()
    me = Watched("a", TIMING, clock)
    assert attempt(me, store, clock)
    assert seen == [(True, 1)], "never leading in the old term"


def test_a_standby_waits_a_whole_lease_from_when_it_saw_the_last_change() -> None:
    clock, store = Clock(), Store()
    leader, standby = Election("a", TIMING, clock), Election("b", TIMING, clock)
    attempt(leader, store, clock)
    for _ in range(20):  # the leader renews every retry period: never taken over
        clock.now += 2
        assert attempt(leader, store, clock)
        assert not attempt(standby, store, clock)
    assert standby.term == 0
    # the leader stops renewing; the standby saw its last renewal at this instant
    clock.now += 14.9
    assert not attempt(standby, store, clock), "14.9 s: not yet"
    clock.now += 0.1
    assert attempt(standby, store, clock), "15 s after it saw the record last change"
    assert store.record is not None
    assert (store.record.holder, store.record.transitions) == ("b", 1)
    assert standby.leading()
    assert not leader.leading()


def test_the_time_a_holder_wrote_is_never_compared_with_this_replicas_clock() -> None:
    """A holder whose clock is an hour slow still holds the Lease while it renews; one whose
    clock is an hour fast does not keep it past a lease once it stops."""
    clock, store = Clock(), Store()
    standby = Election("b", TIMING, clock)
    slow = LeaseRecord("a", 15, WALL, WALL - timedelta(hours=1), 0, "")
    store.record = replace(slow, version="1")
    for n in range(2, 12):
        clock.now += 2
        renewed = clock.wall() - timedelta(hours=1)
        store.record = replace(store.record, renewed=renewed, version=str(n))
        assert not attempt(standby, store, clock)
    store.version = 11
    store.record = replace(store.record, renewed=clock.wall() + timedelta(hours=1))
    assert not attempt(standby, store, clock), "a changed record: the wait starts again"
    clock.now += 15
    assert attempt(standby, store, clock)


def test_the_holders_own_duration_is_what_a_standby_waits() -> None:
    clock, store = Clock(), Store()
    store.record, store.version = LeaseRecord("a", 40, WALL, WALL, 3, "1"), 1
    standby = Election("b", TIMING, clock)
    assert not attempt(standby, store, clock)
    clock.now += 39
    assert not attempt(standby, store, clock), "the holder vouched for 40 s, not our 15"
    clock.now += 1
    assert attempt(standby, store, clock)
    assert store.record is not None
    assert store.record.transitions == 4


def test_a_paused_leader_wakes_up_not_leading_and_stops_before_a_standby_may_start() -> None:
    """SIGSTOP: the leader renewed (sent at t0), then nothing ran for a while. It leads only
    until t0 + renew deadline by its own clock; the standby, which saw that renewal no sooner
    than t0, may take over only at t0 + lease duration."""
    clock, store = Clock(), Store()
    leader, standby = Election("a", TIMING, clock), Election("b", TIMING, clock)
    attempt(leader, store, clock)
    attempt(standby, store, clock)
    t0 = clock.now
    while clock.now < t0 + 30:
        clock.now += 0.5
        took = attempt(standby, store, clock)
        assert not (leader.leading() and standby.leading()), f"both lead at +{clock.now - t0}"
        if took:
            break
    assert clock.now - t0 == pytest.approx(TIMING.lease_duration, abs=0.5)
    assert not leader.leading(), "woken: its renew deadline has passed"
    assert not attempt(leader, store, clock), "and it cannot take the Lease back"
    assert leader.term == 1
    assert standby.term == 1


def test_a_leader_cut_off_past_its_deadline_takes_its_own_lease_back_in_a_new_term() -> None:
    """The apiserver was away: the leader stopped at its deadline. Nobody took over (the
    standby could not write either), so it takes the Lease back, as a new term: what it
    remembered is forgotten (a new term, ha.terms) before it acts again."""
    clock, store = Clock(), Store()
    leader = Election("a", TIMING, clock)
    attempt(leader, store, clock)
    clock.now += 11
    assert not leader.leading()
    assert attempt(leader, store, clock)
    assert leader.leading()
    assert leader.term == 2
    assert store.record is not None
    assert store.record.transitions == 0, "the same holder"


def test_two_writers_of_one_version_one_wins() -> None:
    clock, store = Clock(), Store()
    a, b = Election("a", TIMING, clock), Election("b", TIMING, clock)
    found = store.get()
    wanted_a, wanted_b = a.claim(found, clock.wall()), b.claim(found, clock.wall())
    assert wanted_a is not None
    assert wanted_b is not None
    a.won(clock(), store.write(wanted_a))
    with pytest.raises(Conflict):
        store.write(wanted_b)
    assert a.leading()
    assert not b.leading()


def test_a_released_lease_is_taken_at_once() -> None:
    clock, store = Clock(), Store()
    leader, standby = Election("a", TIMING, clock), Election("b", TIMING, clock)
    attempt(leader, store, clock)
    attempt(standby, store, clock)
    assert store.record is not None
    handed = leader.release(store.record, clock.wall())
    assert not leader.leading(), "stops leading before the release is written"
    assert handed is not None
    assert handed.holder == ""
    assert handed.duration == 1
    store.write(handed)
    clock.now += 0.1
    assert attempt(standby, store, clock)
    assert standby.leading()
    assert leader.release(store.record, clock.wall()) is None, "not ours to release any more"


def test_a_standby_tries_again_when_the_holders_lease_runs_out() -> None:
    clock, store = Clock(), Store()
    leader, standby = Election("a", TIMING, clock), Election("b", TIMING, clock)
    attempt(leader, store, clock)
    attempt(standby, store, clock)
    assert standby.next_try_in() == TIMING.retry_period
    clock.now += 14.5
    assert standby.next_try_in() == pytest.approx(0.5), "not a whole retry period later"
    assert leader.next_try_in() == TIMING.retry_period


@pytest.mark.parametrize("seed", range(20))
def test_never_two_leaders_whatever_pauses_the_replicas(seed: int) -> None:
    """Three replicas on one Lease, each paused at random (SIGSTOP, a slow machine) for up to
    twice the lease: at no instant do two of them lead, and once the leader is paused for good
    another leads within lease duration + retry period."""
    rng = random.Random(seed)
    clock, store = Clock(), Store()
    replicas = [Election(name, TIMING, clock) for name in "abc"]
    paused_until = [0.0, 0.0, 0.0]
    next_try = [clock.now, clock.now, clock.now]
    step = 0.25
    end = clock.now + 600
    while clock.now < end:
        clock.now += step
        for n, election in enumerate(replicas):
            if clock.now < paused_until[n]:
                continue
            if rng.random() < 0.01:
                paused_until[n] = clock.now + rng.uniform(0, 2 * TIMING.lease_duration)
                continue
            if clock.now >= next_try[n]:
                attempt(election, store, clock)
                next_try[n] = clock.now + election.next_try_in()
        leading = [e.identity for e in replicas if e.leading()]
        assert len(leading) <= 1, f"{leading} lead at once (seed {seed}, t={clock.now})"
    holder = next((n for n, e in enumerate(replicas) if e.leading()), 0)
    frozen = clock.now
    paused_until = [0.0, 0.0, 0.0]
    paused_until[holder] = float("inf")
    while not any(e.leading() for n, e in enumerate(replicas) if n != holder):
        clock.now += step
        for n, election in enumerate(replicas):
            if n != holder and clock.now >= next_try[n]:
                attempt(election, store, clock)
                next_try[n] = clock.now + election.next_try_in()
        assert clock.now - frozen <= TIMING.lease_duration + TIMING.retry_period + step


def test_a_new_terms_memories_replace_the_old_before_the_replica_is_said_to_lead() -> None:
    """Renewals keep the term's memories; a term begun after the renew deadline passed gets
    new ones, in place before anyone is told this replica leads."""
    clock, store = Clock(), Store()
    terms = Terms(dict[str, str])
    seen: list[tuple[bool, int]] = []

    def begin() -> None:
        seen.append((election.leading(), id(terms.current)))
        terms.begin()

    election = Election("a", TIMING, clock, begin=begin)
    gate = ActiveGate(election)
    first = terms.current
    assert not gate.active_now()
    attempt(election, store, clock)
    assert gate.active_now()
    term = terms.current
    assert term is not first
    assert seen == [(False, id(first))], "replaced before it led"
    term["remembered"] = "in the first term"
    clock.now += 2
    attempt(election, store, clock)  # a renewal: the same term
    assert terms.current is term
    assert election.term == 1
    clock.now += 10  # the renew deadline passed: no yes is remembered past it
    assert not gate.active_now()
    attempt(election, store, clock)
    assert gate.active_now()
    assert terms.current == {}, "nothing of the first term is kept"
    assert election.term == 2
    assert seen[1] == (False, id(term))
    assert gate.last


def test_standalone_is_always_active() -> None:
    gate = ActiveGate(None)
    assert gate.active_now()
    assert gate.last


class FakeLock:
    """A LeaseLock over a Store, that can be made to fail."""

    def __init__(self, store: Store) -> None:
        self.store, self.failing = store, False

    def __str__(self) -> str:
        return "Lease test/lock"

    def get(self) -> LeaseRecord | None:
        if self.failing:
            raise OSError("connection refused")
        return self.store.get()

    def write(self, record: LeaseRecord) -> LeaseRecord:
        if self.failing:
            raise OSError("connection refused")
        return self.store.write(record)


def test_the_elector_renews_survives_failures_and_releases_when_stopped() -> None:
    clock, store = Clock(), Store()
    lock = FakeLock(store)
    elector = LeaseElector(lock, Election("a", TIMING, clock), clock=clock.wall, steady=clock)
    assert elector.try_once()
    assert elector.election.leading()
    lock.failing = True
    clock.now += 2
    assert not elector.try_once()
    assert elector.election.leading(), "one failed renewal: still within the deadline"
    clock.now += 8
    assert not elector.try_once()
    assert not elector.election.leading()
    lock.failing = False
    assert elector.try_once()
    assert elector.election.term == 2
    elector.stop()
    assert store.record is not None
    assert store.record.holder == ""
    assert not elector.election.leading()


def test_the_elector_tells_of_a_term_begun_in_its_thread_once_the_replica_leads() -> None:
    clock, store = Clock(), Store()
    elector = LeaseElector(
        FakeLock(store), Election("a", TIMING, clock), clock=clock.wall, steady=clock
    )
    told = threading.Event()
    leading: list[bool] = []

    def on_term() -> None:
        leading.append(elector.election.leading())
        told.set()

    elector.start(on_term=on_term)
    assert told.wait(10), "a term began: told"
    elector.stop()
    assert leading == [True]
    assert elector.election.term == 1


def test_a_standby_elector_releases_nothing() -> None:
    clock, store = Clock(), Store()
    attempt(Election("a", TIMING, clock), store, clock)
    elector = LeaseElector(
        FakeLock(store), Election("b", TIMING, clock), clock=clock.wall, steady=clock
    )
    assert not elector.try_once()
    elector.stop()
    assert store.record is not None
    assert store.record.holder == "a"


class Rest:
    """The kubernetes client's REST client, as far as the fence sees it."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def request(self, method: str, url: str, **_: object) -> str:
        self.sent.append(f"{method} {url}")
        return "answer"


class Api:
    def __init__(self) -> None:
        self.rest_client = Rest()


def test_writes_are_not_sent_unless_this_replica_leads_and_reads_always_are() -> None:
    api, leads = Api(), [True]
    fence_writes(cast(Any, api), lambda: leads[0])
    request = api.rest_client.request
    assert request("PATCH", "/api/v1/pods/x") == "answer"
    leads[0] = False
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        with pytest.raises(NotLeading, match="does not lead"):
            request(method, "/api/v1/pods/x")
    assert request("GET", "/api/v1/pods/x") == "answer"
    assert api.rest_client.sent == ["PATCH /api/v1/pods/x", "GET /api/v1/pods/x"]


def test_the_lease_lives_where_it_is_told_else_in_the_service_accounts_namespace(
    tmp_path: pytest.TempPathFactory,
) -> None:
    account = tmp_path / "namespace"  # type: ignore[operator]
    assert lease_namespace("ops", account) == "ops"
    assert lease_namespace("", account) == "default"
    account.write_text("gpuusage-system\n")
    assert lease_namespace("", account) == "gpuusage-system"


def test_a_stopping_elector_stops_leading_even_when_the_lease_cannot_be_released() -> None:
    clock, store = Clock(), Store()
    lock = FakeLock(store)
    elector = LeaseElector(lock, Election("a", TIMING, clock), clock=clock.wall, steady=clock)
    assert elector.try_once()
    lock.failing = True
    elector.stop()
    assert not elector.election.leading(), "no write of this replica after it stopped"
    assert store.record is not None
    assert store.record.holder == "a", "not released: the others wait for the lease to run out"
