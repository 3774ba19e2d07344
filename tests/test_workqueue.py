"""The work queue of report names: one worker per name, deadlines, backoff, reasons."""

from __future__ import annotations

import threading

from gpuusage.retry import Backoff
from gpuusage_operator.controller.workqueue import WorkQueue
from tests.builders import deadline_entries


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def queue(clock: Clock) -> WorkQueue:
    return WorkQueue(clock, Backoff((1.0, 2.0, 4.0), then=8.0, jitter=0.0))


def test_a_name_added_many_times_is_processed_once_with_every_reason() -> None:
    q = queue(Clock())
    q.add("n1", "event")
    q.add("n1", ("edited", "uid", "7"))
    q.add("n2")
    q.add("n1")
    assert len(q) == 2
    assert q.get(0) == ("n1", frozenset({"event", ("edited", "uid", "7")}))
    assert q.get(0) == ("n2", frozenset())
    assert q.get(0) is None


def test_a_name_is_never_processed_twice_at_once_nor_lost() -> None:
    q = queue(Clock())
    q.add("n1", "event")
    name, _ = q.get(0) or ("", frozenset())
    q.add("n1", "due")  # added while a worker has it
    assert q.get(0) is None, "not handed to a second worker meanwhile"
    q.done(name)
    assert q.get(0) == ("n1", frozenset({"due"})), "processed once more afterwards"
    q.done("n1")
    assert q.get(0) is None


def test_deadlines_hold_a_name_and_the_earliest_stands() -> None:
    clock = Clock()
    q = queue(clock)
    q.add_after("late", 30)
    q.add_after("soon", 10)
    q.add_after("soon", 20)  # a later deadline for it changes nothing
    q.add_after("now", 0)
    assert q.get(0) == ("now", frozenset())
    assert q.get(0) is None
    clock.now += 9.5
    assert q.get(0) is None, "held until its deadline"
    clock.now += 0.5
    assert q.get(0) == ("soon", frozenset())
    q.done("soon")
    q.add_after("late", 5)  # an earlier one replaces it
    clock.now += 5
    assert q.get(0) == ("late", frozenset())
    q.done("late")
    clock.now += 100
    assert q.get(0) is None, "the replaced deadline does not bring it back"


def test_failures_back_off_doubling_and_success_starts_over() -> None:
    clock = Clock()
    q = queue(clock)
    delays = [q.add_rate_limited("n1") for _ in range(5)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    q.forget("n1")
    assert q.add_rate_limited("n1") == 1.0
    assert q.get(0) is None
    clock.now += 1
    assert q.get(0) == ("n1", frozenset({"retry"}))


def test_a_waiting_worker_wakes_for_a_deadline_and_for_shut_down() -> None:
    q = WorkQueue()
    q.add_after("n1", 0.05)
    assert q.get(5) == ("n1", frozenset()), "woken by the deadline, well before 5 s"
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(q.get()))
    worker.start()
    q.shut_down()
    worker.join(5)
    assert got == [None]
    q.add("n2")
    assert q.get(0) is None, "nothing is queued once shut down"


def test_a_deadlines_reason_is_told_when_the_deadline_comes() -> None:
    clock = Clock()
    q = queue(clock)
    q.add_after("n1", 10, "staleness")
    q.add_after("n1", 20, "deadline")  # later: comes with the earlier one
    q.add("n1", "event")
    assert q.get(0) == ("n1", frozenset({"event"})), "not the deadlines' reasons yet"
    q.done("n1")
    clock.now += 10
    assert q.get(0) == ("n1", frozenset({"staleness", "deadline"}))


def test_a_replaced_deadline_is_not_kept_until_its_own_time() -> None:
    """A report reconciled again and again: each reconcile gives its staleness deadline an
    hour away, each event a deadline a second away, which replaces it. The queue holds about
    one entry per name, however often that happens."""
    clock = Clock()
    q = queue(clock)
    for _ in range(1000):
        q.add_after("n1", 3600, "staleness")
        q.add_after("n2", 3600, "staleness")
        q.add_after("n1", 1, "event")
        clock.now += 1
        assert q.get(0) == ("n1", frozenset({"event", "staleness"}))
        q.done("n1")
    assert deadline_entries(q) <= 2 * 2 + 16
    clock.now += 2599
    assert q.get(0) is None, "the other name's deadline stands"
    clock.now += 1
    assert q.get(0) == ("n2", frozenset({"staleness"}))
