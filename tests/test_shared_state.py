"""The operator's state that its workers' threads share: the cluster-wide write budget and the
write counters. Many threads at once, switching as often as the interpreter allows: not one
write over the budget, not one count lost."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpuusage_operator.controller import reconcile
from gpuusage_operator.controller.reconcile import Counts
from gpuusage_operator.writers import budget as write_budget
from gpuusage_operator.writers.budget import WriteBudget

THREADS = 16


@pytest.fixture(autouse=True)
def switch_often() -> Iterator[None]:
    """Threads switch after every few bytecodes: a race left open shows at once."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _together(work: Callable[[], None]) -> None:
    start = threading.Barrier(THREADS)

    def run() -> None:
        start.wait()
        work()

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_the_write_budget_is_never_overspent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread may be switched out between reading the tokens and spending them (here at the
    refill, made a switch point): the lock keeps every other thread out meanwhile."""
    refill = write_budget.refilled

    def switching(*args: Any) -> float:
        time.sleep(0)  # let another thread run here, as the interpreter may
        return refill(*args)

    monkeypatch.setattr(write_budget, "refilled", switching)
    budget = WriteBudget(rate=0.0, burst=2000)
    budget.take(0.0, 0)  # the clock starts: every later take refills
    granted = [0] * THREADS
    index = iter(range(THREADS))
    lock = threading.Lock()

    def spend() -> None:
        with lock:
            mine = next(index)
        for _ in range(500):
            granted[mine] += budget.take(0.0)

    _together(spend)
    assert sum(granted) == 2000


def test_no_count_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread may be switched out between reading a count and writing it back (here at the
    read, made a switch point): the lock keeps every other thread's count meanwhile."""

    def switching(*args: Any) -> Any:
        time.sleep(0)
        return getattr(*args)

    monkeypatch.setattr(reconcile, "getattr", switching, raising=False)
    counts = Counts()

    def count() -> None:
        for _ in range(2000):
            counts.add("pod_writes")
            counts.failed("Conflict")

    _together(count)
    assert counts.pod_writes == THREADS * 2000
    assert counts.api_errors["Conflict"] == THREADS * 2000
