"""The report cache (informers.reportwatch) and the worker that reads from it: every change queues
the report's name, never its body; a worker reconciles the report as the cache holds it when
it takes the name, and a report the cache lacks is gone."""

from __future__ import annotations

import json
from collections.abc import Hashable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpuusage_operator.controller.debounce import Debounce
from gpuusage_operator.controller.reportbook import ReportBook, ReportMemory
from gpuusage_operator.controller.term import new_terms
from gpuusage_operator.controller.triggers import EVENT, Triggers
from gpuusage_operator.controller.workers import ReportWorkers
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.informers.informer import WatchExpired
from gpuusage_operator.informers.reportwatch import ReportStore, ReportWatch
from tests.builders import fixed

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def report(name: str, rv: str, used: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "gpuusage.io/v1alpha1",
        "kind": "GpuNodeUsage",
        "metadata": {
            "name": name,
            "resourceVersion": rv,
            "managedFields": [{"manager": "gpuusage-agent", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {"nodeName": name, "gpus": [{"usedMemoryMiB": used}]},
    }


class FakeRaw:
    def __init__(self, body: bytes) -> None:
        self.data = body

    def stream(self, size: int, decode_content: bool = True) -> Any:
        yield self.data

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeCustom:
    """Lists pages in turn; a watch streams `events` once, then an expiry (a list again)."""

    def __init__(self, pages: list[list[dict[str, Any]]], events: list[dict[str, Any]]) -> None:
        self.pages, self.events = pages, events
        self.version = 0

    def list_cluster_custom_object(self, *args: Any, **kwargs: Any) -> FakeRaw:
        if kwargs.get("watch"):
            expired = {"type": "ERROR", "object": {"code": 410, "message": "too old"}}
            events, self.events = [*self.events, expired], []
            return FakeRaw(b"".join(json.dumps(e).encode() + b"\n" for e in events))
        self.version += 1
        page = {"metadata": {"resourceVersion": str(self.version)}, "items": self.pages.pop(0)}
        return FakeRaw(json.dumps(page).encode())


def test_the_store_keeps_compact_bodies_and_hands_out_fresh_copies() -> None:
    store = ReportStore()
    store.apply("ADDED", report("n1", "1", used=5))
    got = store.get("n1")
    assert got is not None
    assert got["spec"] == {"nodeName": "n1", "gpus": [{"usedMemoryMiB": 5}]}
    assert "managedFields" not in got["metadata"], "what no reconcile reads is not kept"
    got["spec"]["gpus"] = []
    assert store.get("n1") == got | {"spec": {"nodeName": "n1", "gpus": [{"usedMemoryMiB": 5}]}}
    assert store.get("n2") is None
    store.apply("DELETED", report("n1", "2"))
    assert (store.get("n1"), len(store)) == (None, 0)


def test_each_change_queues_the_name_and_a_list_again_queues_what_differs() -> None:
    """The first list queues every report; the watch's changes queue their names (not the
    echo of our own status write); a list after an expired watch queues the reports that
    changed or went meanwhile, and no other."""
    queue, book = WorkQueue(), ReportBook()
    echoes: list[int] = []
    triggers = Triggers(queue, fixed(book), echoed=lambda: echoes.append(1))
    book.put("n2", ReportMemory(echo="12"))
    custom = FakeCustom(
        pages=[
            [report("n1", "1"), report("n2", "2"), report("n3", "3")],
            [report("n1", "1"), report("n2", "12"), report("n4", "14"), report("n5", "15")],
        ],
        events=[
            {"type": "MODIFIED", "object": report("n2", "12")},  # our echo
            {"type": "MODIFIED", "object": report("n1", "11", used=9)},
            {"type": "DELETED", "object": report("n3", "13")},
            {"type": "ADDED", "object": report("n4", "14")},
        ],
    )
    listed: list[set[str]] = []

    def on_listed(names: set[str]) -> None:
        listed.append(set(names))
        triggers.reports_listed(names)

    watch = ReportWatch(custom, on_event=triggers.report_changed, on_listed=on_listed)
    watch.list_all()
    assert listed == [{"n1", "n2", "n3"}]
    assert {name for name, _ in drain(queue)} == {"n1", "n2", "n3"}
    with pytest.raises(WatchExpired, match="too old"):
        watch._watch("1")
    assert drain(queue) == [("n1", {EVENT}), ("n3", {EVENT}), ("n4", {EVENT})]
    assert echoes == [1], "the echo of our own write is counted, not queued"
    assert watch.get("n1") == {
        **report("n1", "11", used=9),
        "metadata": {"name": "n1", "resourceVersion": "11"},
    }
    assert watch.get("n3") is None
    watch.list_all()
    assert listed[-1] == {"n1", "n5"}, "n1 differs from what the watch last showed, n5 is new"
    assert watch.names() == {"n1", "n2", "n4", "n5"}


def drain(queue: WorkQueue) -> list[tuple[str, set[Hashable]]]:
    taken = []
    while len(queue):
        got = queue.get()
        assert got is not None
        taken.append((got[0], set(got[1])))
        queue.done(got[0])
    return taken


class Reconciler:
    """What a worker calls, recorded."""

    def __init__(self) -> None:
        self.queue = WorkQueue()
        self.terms = new_terms()
        self.counted: list[str] = []
        self.counts = SimpleNamespace(add=self.counted.append)
        self.calls: list[tuple[str, Any]] = []

    @property
    def book(self) -> ReportBook:
        return self.terms.current.book

    def forget_pods(self, uids: set[str]) -> None:
        pass

    def needs_reconcile(self, name: str, reasons: frozenset[Hashable], now: datetime) -> bool:
        return True

    def reconcile(self, body: dict[str, Any], lookup: Any, now: datetime, dra: Any) -> bool:
        self.calls.append(("reconcile", body["metadata"]["resourceVersion"]))
        return False

    def forget_node(self, node: str, lookup: Any, now: datetime) -> None:
        self.calls.append(("forget_node", node))


def test_a_worker_reconciles_what_the_cache_holds_when_it_takes_the_name() -> None:
    """The latest version, read when the name is taken; a report the cache lacks loses its
    pods' marks at once, even within the debounce interval of its last reconcile."""
    cache: dict[str, dict[str, Any]] = {"n1": report("n1", "1")}
    reconciler = Reconciler()
    index = cast(Any, SimpleNamespace(lookup=lambda: None))
    workers = ReportWorkers(
        cast(Any, reconciler),
        index,
        index,
        cast(Any, SimpleNamespace(active_now=lambda: True)),
        cast(Any, SimpleNamespace(reports_held=SimpleNamespace(inc=lambda: None))),
        read=cache.get,
        debounce=Debounce(3600.0),
        clock=lambda: NOW,
        ready=lambda: True,
        workers=1,
    )
    assert workers.work("n1", frozenset({EVENT}))
    cache["n1"] = report("n1", "2")
    assert not workers.work("n1", frozenset({EVENT})), "held: reconciled within the interval"
    del cache["n1"]
    assert workers.work("n1", frozenset({EVENT})), "gone: not held"
    assert reconciler.calls == [("reconcile", "1"), ("forget_node", "n1")]


def test_an_echo_queued_before_its_reconcile_recorded_it_costs_no_reconcile() -> None:
    """The watch can show our status write before the reconcile that made it has recorded it:
    the name is queued, and the worker, taking it once that reconcile is over, skips it."""
    echo = report("n1", "12")
    reconciler = Reconciler()
    book = reconciler.book
    reconciler_any = cast(Any, reconciler)
    triggers = Triggers(reconciler.queue, lambda: reconciler.book)
    triggers.report_changed("n1", echo)  # before the reconcile recorded its write
    assert drain(reconciler.queue) == [("n1", {EVENT})]
    book.put("n1", ReportMemory(echo="12"))  # the reconcile's last step
    index = cast(Any, SimpleNamespace(lookup=lambda: None))
    workers = ReportWorkers(
        reconciler_any,
        index,
        index,
        cast(Any, SimpleNamespace(active_now=lambda: True)),
        cast(Any, None),
        read={"n1": echo}.get,
        debounce=Debounce(),
        clock=lambda: NOW,
        ready=lambda: True,
        workers=1,
    )
    assert not workers.work("n1", frozenset({EVENT}))
    assert (reconciler.calls, reconciler.counted) == ([], ["echoes_skipped"])
    reconciler.terms.begin()  # a new term: another replica may have judged and written since
    assert workers.work("n1", frozenset({EVENT})), "no longer taken for our echo"
    assert reconciler.calls == [("reconcile", "12")]
    reconciler.calls.clear()
    workers._debounce.forget("n1")
    assert workers.work("n1", frozenset({EVENT, "deadline"})), "another reason: reconciled"
    assert reconciler.calls == [("reconcile", "12")]
