"""Who leads: client-go's leader election over a `coordination.k8s.io` Lease, as a pure rule.

The clock is a steady one passed in (seconds that never jump; see leader for which), and the
wall clock only stamps what is written, so no decision compares a time another machine wrote
with this machine's clock (their skew would then decide):

* A replica may take the Lease when it has no holder, when it holds it already, or when the
  holder's record has not changed (holder, renewTime, leaseTransitions, resourceVersion) for
  the holder's own leaseDurationSeconds as *this* replica's clock measured it since it first
  saw that record.
* Every write names the resourceVersion it read (optimistic concurrency): of two replicas
  that try at once, one gets 409 and stays on standby.
* The leader renews every retry period and counts as leading only while its last renewal
  that succeeded was *sent* less than the renew deadline ago. The renew deadline is shorter
  than the lease duration, so a leader that could not renew (paused by SIGSTOP, cut off from
  the apiserver, its renewals refused) has stopped before any other replica may take over:
  another waits a whole lease duration from the moment it saw that renewal, which was sent
  earlier still.
* A leader that stops cleanly stops leading first, then empties holderIdentity (client-go's
  ReleaseOnCancel), so that a standby takes over at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

LEASE_DURATION = 15.0
RENEW_DEADLINE = 10.0
RETRY_PERIOD = 2.0
"""client-go's defaults (seconds), which kube-scheduler and kube-controller-manager use."""
RELEASED_DURATION = 1
"""The leaseDurationSeconds a released Lease says, as client-go writes it."""


class TimingError(ValueError):
    """lease duration > renew deadline > retry period does not hold."""


@dataclass(frozen=True)
class Timing:
    """How long a Lease holds, how long its leader may go without renewing, how often it
    tries (seconds)."""

    lease_duration: float = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD

    def __post_init__(self) -> None:
        problem = timing_problem(self.lease_duration, self.renew_deadline, self.retry_period)
        if problem:
            raise TimingError(problem)


def timing_problem(lease_duration: float, renew_deadline: float, retry_period: float) -> str:
    """What is wrong with these durations (empty: nothing). A renew deadline not shorter than
    the lease would let an old leader act after another took over; a retry period not shorter
    than the renew deadline would let a healthy leader lapse between two renewals."""
    if min(lease_duration, renew_deadline, retry_period) <= 0:
        return "the lease duration, renew deadline and retry period must be positive"
    if renew_deadline >= lease_duration:
        return (
            f"the renew deadline ({renew_deadline:g} s) must be shorter than the lease duration "
            f"({lease_duration:g} s), so that a leader that cannot renew stops before another "
            "replica may take over"
        )
    if retry_period >= renew_deadline:
        return (
            f"the retry period ({retry_period:g} s) must be shorter than the renew deadline "
            f"({renew_deadline:g} s), so that a leader renews before its deadline passes"
        )
    return ""


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says about its holder (spec), and the version it was read at."""

    holder: str = ""
    """holderIdentity; empty: nobody holds it (never taken, or released)."""
    duration: float = 0.0
    """leaseDurationSeconds the holder vouches for; 0 where it says none."""
    acquired: datetime | None = None
    renewed: datetime | None = None
    transitions: int = 0
    version: str = ""
    """metadata.resourceVersion; empty for a Lease not created yet."""

    def same_as(self, other: LeaseRecord | None) -> bool:
        """Whether `other` shows no sign of life since this one (what client-go compares)."""
        return other is not None and (
            self.holder,
            self.renewed,
            self.transitions,
            self.version,
        ) == (other.holder, other.renewed, other.transitions, other.version)


class Election:
    """One replica's view of the Lease and of its own leadership; no I/O.

    The edge (leader.LeaseElector) reads the Lease, asks `claim` what to write, writes it on
    the version read, and reports the outcome with `won`; the gate asks `leading`.
    """

    def __init__(
        self,
        identity: str,
        timing: Timing,
        steady: Callable[[], float],
        begin: Callable[[], None] = lambda: None,
    ) -> None:
        self.identity, self.timing, self._steady = identity, timing, steady
        self._begin = begin
        """Replaces the replica's memories for a new term (ha.terms.Terms.begin)."""
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        self.term = 0
        """How many times this replica has started leading: a new term means another replica
        may have written meanwhile."""

    def leading(self) -> bool:
        """Whether this replica may act now: its last successful renewal was sent less than
        the renew deadline ago."""
        return (
            self._renewed_at is not None
            and self._steady() - self._renewed_at < self.timing.renew_deadline
        )

    def observe(self, record: LeaseRecord | None) -> None:
        """The Lease as just read (None: there is none); a changed record restarts the wait
        for its holder's lease to run out."""
        if record is None or not record.same_as(self._observed):
            self._observed, self._observed_at = record, self._steady()

    def expires_in(self) -> float | None:
        """Seconds until the observed holder's lease runs out by this replica's clock (None:
        nothing observed, or no other holder)."""
        found = self._observed
        if found is None or not found.holder or found.holder == self.identity:
            return None
        duration = found.duration or self.timing.lease_duration
        return self._observed_at + duration - self._steady()

    def claim(self, record: LeaseRecord | None, now: datetime) -> LeaseRecord | None:
        """What to write to hold the Lease, read as `record` (None: create it), at wall time
        `now`; None while another holder's lease runs. Observes `record` first."""
        self.observe(record)
        if record is None:
            return LeaseRecord(self.identity, self.timing.lease_duration, now, now, 0, "")
        left = self.expires_in()
        if left is not None and left > 0:
            return None
        if record.holder == self.identity:
            return replace(record, duration=self.timing.lease_duration, renewed=now)
        return LeaseRecord(
            self.identity,
            self.timing.lease_duration,
            now,
            now,
            record.transitions + 1,
            record.version,
        )

    def won(self, sent_at: float, written: LeaseRecord) -> bool:
        """A write sent at steady time `sent_at` was accepted and stored as `written`; whether
        this starts a new term (this replica was not leading when it sent it). A new term's
        memories replace the old ones before the replica leads: whoever sees it lead sees
        them, never what it remembered from before another replica's term."""
        new_term = not (
            self._renewed_at is not None and sent_at - self._renewed_at < self.timing.renew_deadline
        )
        if new_term:
            self._begin()
            self.term += 1
        self._renewed_at = sent_at
        self._observed, self._observed_at = written, self._steady()
        return new_term

    def resign(self) -> None:
        """Stop leading at once (before the Lease is handed over, so that nothing of this
        replica is written after another may have taken it)."""
        self._renewed_at = None

    def release(self, record: LeaseRecord, now: datetime) -> LeaseRecord | None:
        """Resign; the record that hands the Lease over (None: it is not ours to release)."""
        self.resign()
        if record.holder != self.identity:
            return None
        return LeaseRecord("", RELEASED_DURATION, now, now, record.transitions, record.version)

    def next_try_in(self) -> float:
        """Seconds until the next attempt: the retry period, or less when the observed
        holder's lease runs out sooner (a standby then takes over within a retry period of
        that moment, not of the next tick)."""
        left = self.expires_in()
        if left is None or left <= 0 or self.leading():
            return self.timing.retry_period  # (ran out already: this try failed)
        return min(self.timing.retry_period, left)
