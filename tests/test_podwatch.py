"""The operator's own pod index: events applied as an informer would, relists replace."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage_operator.index.pods import snapshot_of
from gpuusage_operator.informers.podwatch import IndexState, PodWatch

CID_A, CID_B = "a" * 64, "b" * 64
UID_1, UID_2 = "11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222"


def pod(
    uid: str, name: str, cid: str | None, marked: bool = False, rv: str = "1"
) -> dict[str, Any]:
    meta: dict[str, Any] = {"uid": uid, "name": name, "namespace": "ml", "resourceVersion": rv}
    if marked:
        meta["annotations"] = {names.ANNOTATION_GPUS: "GPU-x"}
    statuses = [{"name": "main", "containerID": f"containerd://{cid}"}] if cid else []
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": {"containerStatuses": statuses}}


def test_events_add_change_and_remove_keys() -> None:
    """Pods with our marks (or GPUs) are kept whole, keyed by UID and container IDs; plain
    pods are packed under their UID alone, and a pod moves between the two as it changes."""
    state = IndexState()
    state.apply("ADDED", pod(UID_1, "p1", None))
    assert state.kept.all_keys() == [], "a plain pod has no keys"
    assert state.lookup().by_uid(UID_1) == snapshot_of(pod(UID_1, "p1", None))
    state.apply("MODIFIED", pod(UID_1, "p1", CID_A, marked=True, rv="2"))
    state.apply("ADDED", pod(UID_2, "p2", CID_B))
    assert set(state.kept.all_keys()) == {f"cid:{CID_A}", "marked:n1"}
    assert state.kept.uids() == {UID_1}
    assert state.plain.uids() == {UID_2}
    lookup = state.lookup()
    assert lookup.by_container(CID_A) == snapshot_of(pod(UID_1, "p1", CID_A, True, "2"))
    assert lookup.by_container(CID_B) is None, "plain: no key per container"
    assert lookup.plain_with_container(CID_B) == snapshot_of(pod(UID_2, "p2", CID_B))
    assert lookup.by_uid(UID_2) == snapshot_of(pod(UID_2, "p2", CID_B))
    assert len(state) == 2
    assert state.ids() == {UID_1, UID_2}
    # Our marks gone and a container restarted: plain again, the old keys are gone.
    state.apply("MODIFIED", pod(UID_1, "p1", "c" * 64, rv="3"))
    assert state.kept.all_keys() == []
    assert len(state.kept) == 0
    assert state.lookup().by_uid(UID_1) == snapshot_of(pod(UID_1, "p1", "c" * 64, rv="3"))
    state.apply("DELETED", pod(UID_2, "p2", CID_B))
    assert state.lookup().by_uid(UID_2) is None
    assert state.lookup().plain_with_container(CID_B) is None
    assert len(state) == 1
    state.apply("DELETED", {"metadata": {}})  # no uid: ignored, no crash


def test_a_plain_pod_that_gains_marks_is_heard() -> None:
    """Someone (or our own write) puts a gpuusage.io/ annotation on a plain pod: the
    level-triggered comparison hears it as it would for a pod kept whole."""
    heard: list[str | None] = []
    state = IndexState(on_marks=lambda ref: heard.append(ref.resource_version))
    state.apply("ADDED", pod(UID_1, "p1", CID_A))
    state.apply("MODIFIED", pod(UID_1, "p1", CID_A, marked=True, rv="2"))
    state.apply("MODIFIED", pod(UID_1, "p1", CID_A, rv="3"))
    assert heard == ["2", "3"]


def test_a_deleted_pod_is_heard_with_its_node_once_the_index_lacks_it() -> None:
    """The watch queues the node of a deleted pod, so that a report listing it is judged
    again; whoever acts on it reads an index that no longer has the pod."""
    heard: list[tuple[str, str, bool]] = []
    state = IndexState()
    state.on_gone = lambda node, uid: heard.append((node, uid, state.get(uid) is None))
    state.apply("ADDED", pod(UID_1, "p1", CID_A, marked=True))  # kept whole
    state.apply("ADDED", pod(UID_2, "p2", CID_B))  # packed
    state.apply("DELETED", pod(UID_1, "p1", CID_A, marked=True, rv="2"))
    state.apply("DELETED", pod(UID_2, "p2", CID_B, rv="3"))
    assert heard == [("n1", UID_1, True), ("n1", UID_2, True)]
    unscheduled = pod(UID_1, "p1", None)
    unscheduled["spec"] = {}
    state.apply("ADDED", unscheduled)
    state.apply("DELETED", unscheduled)
    assert len(heard) == 2, "a pod that never had a node is on no report"


def test_the_hooks_are_told_once_the_index_shows_the_change() -> None:
    """A hook queues the node's report; a worker may take it at once, and must read the pod
    as the event left it, not as it was."""
    seen: list[str | None] = []
    state = IndexState()

    def marks(ref: Any) -> None:
        found = state.get(ref.uid)
        seen.append(found.resource_version if found else None)

    state.on_marks = marks
    state.apply("ADDED", pod(UID_1, "p1", CID_A))
    state.apply("MODIFIED", pod(UID_1, "p1", CID_A, marked=True, rv="2"))
    state.apply("MODIFIED", pod(UID_1, "p1", CID_A, rv="3"))
    assert seen == ["2", "3"]


class FakeRaw:
    """What urllib3 gives back with _preload_content=False."""

    def __init__(self, body: bytes) -> None:
        self.data = body
        self.released = False
        self.closed = False

    def stream(self, size: int, decode_content: bool = True) -> Any:
        for start in range(0, len(self.data), 7):  # lines split across chunks
            yield self.data[start : start + 7]

    def release_conn(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


class FakeCore:
    def __init__(self, pages: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        self.pages, self.events, self.calls = pages, events, []  # type: ignore[var-annotated]
        self.watches: list[FakeRaw] = []

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> FakeRaw:
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            lines = b"".join(json.dumps(e).encode() + b"\n" for e in self.events)
            self.watches.append(FakeRaw(lines))
            return self.watches[-1]
        return FakeRaw(json.dumps(self.pages.pop(0)).encode())


def test_a_pod_starting_or_ending_its_hold_on_gpus_makes_its_node_due() -> None:
    """Its report lists what running pods were handed: a pod that becomes Running with a GPU,
    or stops running, changes that list with no event of the report's own."""
    due: list[set[str]] = []
    state = IndexState(on_requesting=due.append)

    def gpu_pod(phase: str, rv: str) -> dict[str, Any]:
        body = pod(UID_1, "p1", CID_A, rv=rv)
        body["spec"]["containers"] = [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        ]
        body["status"]["phase"] = phase
        return body

    state.apply("ADDED", gpu_pod("Running", "1"))
    assert due == [], "a list (or an ADDED event) makes no node due: all would be at a relist"
    state.apply("MODIFIED", gpu_pod("Running", "2"))
    assert due == [], "still holding: nothing changed"
    state.apply("MODIFIED", gpu_pod("Succeeded", "3"))
    assert due == [{"n1"}]
    state.apply("MODIFIED", gpu_pod("Running", "4"))
    assert due == [{"n1"}, {"n1"}]
    state.apply("MODIFIED", pod(UID_2, "p2", CID_B, rv="5"))  # no GPU at all
    assert len(due) == 2


def test_list_is_paginated_then_watch_resumes_from_its_version() -> None:
    pages = [
        {"metadata": {"continue": "next"}, "items": [pod(UID_1, "p1", CID_A)]},
        {"metadata": {"resourceVersion": "100"}, "items": [pod(UID_2, "p2", CID_B)]},
    ]
    events = [
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "105"}}},
        {"type": "DELETED", "object": pod(UID_1, "p1", CID_A, rv="106")},
    ]
    core = FakeCore(pages, events)
    watch = PodWatch(core)
    version = watch.list_all()
    assert (version, len(watch), watch.synced.is_set()) == ("100", 2, True)
    assert core.calls[1]["_continue"] == "next"
    assert watch._watch(version) == "106"
    assert core.calls[2]["resource_version"] == "100"
    assert watch.lookup().by_uid(UID_1) is None
    assert watch.lookup().plain_with_container(CID_A) is None
    ref = watch.lookup().plain_with_container(CID_B)
    assert ref is not None
    assert ref.name == "p2"


def test_watch_error_means_list_again_and_the_new_list_replaces_the_index() -> None:
    gone = {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    pages = [
        {"metadata": {"resourceVersion": "1"}, "items": [pod(UID_1, "p1", CID_A)]},
        {"metadata": {"resourceVersion": "9"}, "items": [pod(UID_2, "p2", CID_B)]},
    ]
    core = FakeCore(pages, [gone])
    missed: list[tuple[str, str]] = []
    watch = PodWatch(core, retry_seconds=0.01, on_gone=lambda node, uid: missed.append((node, uid)))
    original = watch.state

    def stop_after_relist() -> str:
        version = PodWatch.list_all(watch)
        if watch.relists == 2:
            watch.stop()
        return version

    watch.list_all = stop_after_relist  # type: ignore[method-assign]
    watch.run()
    assert watch.relists == 2
    assert watch.state is not original, "swapped in one assignment"
    assert watch.lookup().by_uid(UID_1) is None, "a pod deleted while expired is dropped"
    assert watch.lookup().by_uid(UID_2) is not None
    assert missed == [("n1", UID_1)], "its node heard of it, from the index it was in"
    left = core.watches[0]
    assert left.closed, "a stream left at its ERROR event is closed: its rest is not reused"
    assert left.released


class Outage(Exception):
    """The API is away."""


class FlakyCore:
    """Lists and watches that fail while `down` says so, as an apiserver being restarted."""

    def __init__(self, script: list[str]) -> None:
        self.script = script  # per call: "list", "list-fails", "watch-breaks", "watch-ends"
        self.version = 0
        self.at_end: Callable[[], None] = lambda: None
        """Called when the loop asks for more than the script holds (the test stops it)."""

    def _next(self, expected: str) -> str:
        step = self.script.pop(0)
        assert step.startswith(expected), f"expected a {expected}, the loop made a {step}"
        return step

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> FakeRaw:
        if kwargs.get("watch"):
            if not self.script:
                self.at_end()
                return FakeRaw(b"")
            if self._next("watch") == "watch-breaks":
                raise Outage("connection reset")
            return FakeRaw(b"")
        if self._next("list") == "list-fails":
            raise Outage("connection refused")
        self.version += 1
        page = {"metadata": {"resourceVersion": str(self.version)}, "items": []}
        return FakeRaw(json.dumps(page).encode())


def test_interruptions_list_again_and_the_backoff_starts_over_after_each_list() -> None:
    """A broken watch is never resumed from its old version: the index is listed again, and
    reports wait (synced cleared) until it is; a long outage's backoff does not carry over."""
    script = [
        "list",
        "watch-breaks",  # first outage: 4 failed lists
        "list-fails",
        "list-fails",
        "list-fails",
        "list-fails",
        "list",
        "watch-ends",
        "watch-breaks",
        "list",
        "watch-breaks",  # two more, each after a good list
        "list",
    ]
    core = FlakyCore(script)
    pauses: list[float] = []
    synced_during_pause: list[bool] = []

    def wait(seconds: float) -> bool:
        pauses.append(seconds)
        synced_during_pause.append(watch.synced.is_set())
        return False

    watch = PodWatch(core, retry_seconds=1.0, wait=wait)
    core.at_end = watch.stop
    watch.run()
    assert core.script == []
    assert watch.relists == 4, "every interruption was followed by a list"
    assert synced_during_pause == [False] * len(pauses), "reports wait while the index is old"
    # First outage: 1, 2, 4, 5 (capped), then the good list: the next ones start at 1 again.
    first, later = pauses[:5], pauses[5:]
    assert [0.5 <= p / b <= 1.0 for p, b in zip(first, (1, 2, 4, 5, 5), strict=True)] == [True] * 5
    assert [0.5 <= p <= 1.0 for p in later] == [True, True], "backoff reset after each list"
    assert watch.synced.is_set()


@pytest.mark.cluster
def test_stop_ends_the_watch_it_is_blocked_in(api: client.ApiClient) -> None:
    """An open watch used to keep the thread (and the apiserver's shutdown) waiting for up to
    300 s after stop()."""
    core = client.CoreV1Api(api)
    opened = threading.Event()

    class Opening:
        """The pod API, saying when a watch's response is in hand (the watch is open)."""

        def list_pod_for_all_namespaces(self, **kwargs: Any) -> Any:
            response = core.list_pod_for_all_namespaces(**kwargs)
            if kwargs.get("watch"):
                opened.set()
            return response

    watch = PodWatch(Opening())
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    assert watch.synced.wait(30)
    assert opened.wait(10)
    watch.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_list_again_tells_what_changed_while_no_watch_was_open() -> None:
    """client-go's Replace: a pod that started holding GPUs, a pod whose marks changed and a
    pod new to the list while the watch was interrupted are heard as MODIFIED events would be;
    the first list tells nothing (every report is judged after it in any case)."""

    def gpu_pod(uid: str, name: str, phase: str, rv: str, marked: bool = False) -> dict[str, Any]:
        body = pod(uid, name, CID_A if uid == UID_1 else CID_B, marked=marked, rv=rv)
        body["spec"]["containers"] = [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        ]
        body["status"]["phase"] = phase
        return body

    gone = {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    pages = [
        {"metadata": {"resourceVersion": "1"}, "items": [gpu_pod(UID_1, "p1", "Pending", "1")]},
        {
            "metadata": {"resourceVersion": "9"},
            "items": [
                gpu_pod(UID_1, "p1", "Running", "5", marked=True),
                gpu_pod(UID_2, "p2", "Running", "7"),
            ],
        },
    ]
    due: list[set[str]] = []
    edited: list[str | None] = []
    watch = PodWatch(
        FakeCore(pages, [gone]),
        retry_seconds=0.01,
        on_requesting=due.append,
        on_marks=lambda ref: edited.append(ref.resource_version),
    )
    watch.list_all()
    assert (due, edited) == ([], []), "the first list tells nothing"

    def stop_after_relist() -> str:
        version = PodWatch.list_all(watch)
        watch.stop()
        return version

    watch.list_all = stop_after_relist  # type: ignore[method-assign]
    watch.run()
    assert watch.relists == 2
    assert due == [{"n1"}], "p1 started holding its GPU, p2 came running with one: one call"
    assert edited == ["5"], "p1's marks changed meanwhile"
