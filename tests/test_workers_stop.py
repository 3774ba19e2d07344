"""A stopping operator's workers: idle ones return at once, a reconcile in progress is waited
for, and one that outlasts the wait is reported, not left to write unseen."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpuusage_operator.controller.triggers import EVENT
from gpuusage_operator.controller.workers import ReportWorkers
from gpuusage_operator.controller.workqueue import WorkQueue


class Blocking(ReportWorkers):
    """Workers whose reconcile waits for `release` (its start told by `started`)."""

    def __init__(self, count: int) -> None:
        reconciler = cast(Any, SimpleNamespace(queue=WorkQueue()))
        nothing = cast(Any, None)
        super().__init__(
            reconciler,
            nothing,
            nothing,
            nothing,
            nothing,
            read=nothing,
            debounce=nothing,
            clock=nothing,
            ready=lambda: True,
            workers=count,
        )
        self.started, self.release = threading.Event(), threading.Event()
        self.finished: list[str] = []

    def work(self, name: str, reasons: frozenset[Hashable]) -> bool:
        self.started.set()
        self.release.wait(30)
        self.finished.append(name)
        return False


@pytest.fixture
def workers() -> Iterator[Blocking]:
    built = Blocking(count=3)
    built.start()
    yield built
    built.release.set()
    built.stop(wait=30)


def test_idle_workers_stop_at_once(workers: Blocking) -> None:
    assert workers.stop(wait=5)
    assert not any(t.is_alive() for t in workers._threads)


def test_a_reconcile_in_progress_is_waited_for(workers: Blocking) -> None:
    workers.queue.add("gpu-1", EVENT)
    assert workers.started.wait(10)
    threading.Timer(0.3, workers.release.set).start()
    assert workers.stop(wait=20), "every worker returned"
    assert workers.finished == ["gpu-1"], "the reconcile finished before stop returned"


def test_a_reconcile_that_outlasts_the_wait_is_reported(
    workers: Blocking, caplog: pytest.LogCaptureFixture
) -> None:
    workers.queue.add("gpu-1", EVENT)
    assert workers.started.wait(10)
    assert not workers.stop(wait=0.2)
    assert workers.finished == []
    assert any("still in progress on reconcile-" in r.getMessage() for r in caplog.records)
