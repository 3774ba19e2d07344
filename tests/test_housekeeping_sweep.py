"""The housekeeping pass's sweep of the Nodes (controller.housekeeping): once a term, the Nodes
that carry our OrphanedGPUMemory marks with no report are queued, so that the worker finds the
report absent and clears them. The pass runs in-process here (its API probe answered by a
stand-in that counts the passes); the listing and the clearing run on the apiserver in
test_node_marks_across_terms and test_policy_rights_on_cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from kubernetes import client

from gpuusage_operator.controller.term import Term, new_terms
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.ha.terms import Terms
from gpuusage_operator.policies.act import Result
from gpuusage_operator.policies.noderule import NodeMarks
from gpuusage_operator.policies.noderun import NodeRunner
from tests.builders import (
    Clock,
    PolicyStatusApi,
    reconciler_on,
    run_housekeeping,
    tainting_runner,
)

START = datetime(2026, 11, 29, 4, 0, tzinfo=UTC)


class Lister:
    """NodeMarker.marked as the apiserver would answer it; which term each call was in."""

    def __init__(self, terms: Terms[Term], answer: set[str] | Result | Exception) -> None:
        self.terms, self.answer = terms, answer
        self.calls: list[Term] = []

    def marked(self) -> set[str] | Result:
        self.calls.append(self.terms.current)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def queued(queue: WorkQueue) -> set[str]:
    names = set()
    while (taken := queue.get(timeout=0)) is not None:
        names.add(taken[0])
        queue.done(taken[0])
    return names


def sweep(
    monkeypatch: pytest.MonkeyPatch,
    answer: set[str] | Result | Exception,
    *,
    new_term_after: int = 0,
) -> tuple[Lister, WorkQueue, Terms[Term]]:
    """Run the pass until 6 passes have probed the API (beginning a new term after
    `new_term_after` of them, where given); what was listed and queued."""
    terms = new_terms()
    lister = Lister(terms, answer)
    runner = NodeRunner(
        tainting_runner(PolicyStatusApi(), Clock(START)),
        lambda *a: None,
        lambda: terms.current.nodes,
        marker=cast(Any, lister),
    )
    reconciler = reconciler_on(client.ApiClient(), nodes=runner, terms=terms)
    probes = 0

    def probed() -> None:
        nonlocal probes
        probes += 1
        if probes == new_term_after:
            terms.begin()

    run_housekeeping(
        reconciler, monkeypatch, lambda: probes >= 6, known=lambda: {"reported"}, probed=probed
    )
    assert probes >= 6, "the passes ran"
    return lister, reconciler.queue, terms


def test_a_term_lists_the_marked_nodes_once_and_queues_those_with_no_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lister, queue, _ = sweep(monkeypatch, {"reported", "gone"})
    assert len(lister.calls) == 1, "once a term, not every pass"
    assert queued(queue) == {"gone"}, "a node with a report is the report's own business"


def test_a_new_term_lists_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    lister, _, terms = sweep(monkeypatch, {"gone"}, new_term_after=3)
    assert len(lister.calls) == 2
    assert lister.calls[-1] is terms.current


def test_a_list_refused_for_now_is_tried_at_the_next_pass_and_one_not_permitted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    busy, _, _ = sweep(monkeypatch, Result("Refused", "429"))
    assert len(busy.calls) >= 5, "every pass, until it answers"
    barred, queue, _ = sweep(monkeypatch, Result("NotPermitted", "cannot list nodes"))
    assert len(barred.calls) == 1, "said once a term"
    assert queued(queue) == set()


def test_a_pass_that_fails_leaves_the_next_to_try_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a pass meets (here the sweep raising), the loop goes on: the probe, the
    OpenReports and the policies' ledger are the next passes' to do."""
    lister, _, _ = sweep(monkeypatch, RuntimeError("the connection was reset"))
    assert len(lister.calls) >= 5, "every pass tried again"


class Marker:
    """NodeMarker over one Node's marks in memory, counting its reads."""

    def __init__(self, marks: NodeMarks) -> None:
        self.marks, self.reads = marks, 0

    def read(self, node: str) -> NodeMarks | Result:
        self.reads += 1
        return self.marks

    def write(self, node: str, wanted: NodeMarks, message: str, now: datetime) -> Result:
        self.marks = wanted
        return Result("Done", message)


def test_a_node_queued_again_and_again_with_no_report_is_read_once() -> None:
    """The housekeeping pass queues a node whose pods carry marks every pass while its report
    is absent: its Node is read (and cleared) once, then known like any node's."""
    terms = new_terms()
    marker = Marker(NodeMarks(condition=True, tainted=True))
    runner = NodeRunner(
        tainting_runner(PolicyStatusApi(), Clock(START)),
        lambda *a: None,
        lambda: terms.current.nodes,
        marker=cast(Any, marker),
    )
    for seconds in range(0, 60, 10):
        runner.forget("gone", START + timedelta(seconds=seconds))
    assert marker.marks == NodeMarks(), "cleared"
    assert marker.reads == 1
