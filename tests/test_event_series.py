"""Events as kubectl users know them: identical ones within ten minutes are one Event with a
count (its series), and each object's Events are rate-limited, so a pod whose process starts
and ends every cycle gets a bounded number of them."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from gpuusage.kube.core import EventApi
from gpuusage_operator.controller.reconcile import Counts
from gpuusage_operator.writers.eventbook import BURST, REFILL, SERIES_WINDOW, EventBook, Write
from gpuusage_operator.writers.events import COMPONENT, EventRecorder
from gpuusage_operator.writers.marks import PodEvent
from tests.conftest import WorldFactory, wait_for
from tests.worldview import condition, pod

T0 = datetime(2026, 11, 25, 12, tzinfo=UTC)
START = ("Pod/ml/train/u1", "GPUUseStarted", "Normal", "started using GPUs")
END = ("Pod/ml/train/u1", "GPUUseEnded", "Normal", "stopped using GPUs")


def test_identical_events_join_a_series_within_the_window() -> None:
    book = EventBook()
    assert book.write_for(START, T0) == Write("new")
    book.written(START, "train.1", T0)
    assert book.write_for(END, T0) == Write("new"), "another reason is another Event"
    book.written(END, "train.2", T0)
    later = T0 + timedelta(minutes=1)
    assert book.write_for(START, later) == Write("series", "train.1", 2)
    assert book.write_for(START, later + timedelta(minutes=9)) == Write("series", "train.1", 3)
    # ten minutes after the last one, a new Event
    assert book.write_for(START, later + timedelta(minutes=9) + SERIES_WINDOW * 1.01).kind == "new"
    book.lost(END)
    assert book.write_for(END, later).kind == "new", "a series whose Event is gone starts anew"


def test_each_objects_events_are_rate_limited_and_the_book_forgets_quiet_objects() -> None:
    book = EventBook()
    other = ("Pod/ml/other/u2", "GPUUseStarted", "Normal", "started using GPUs")
    kinds = [book.write_for(START, T0).kind for _ in range(BURST + 3)]
    assert kinds.count("drop") == 3
    assert book.write_for(other, T0).kind == "new", "the limit is per object"
    assert book.write_for(START, T0 + REFILL * 0.9).kind == "drop"
    assert book.write_for(START, T0 + REFILL * 1.01).kind != "drop", "one back per REFILL"
    book.prune(T0 + REFILL * BURST * 2)
    assert len(book) == 0, "nothing kept of objects quiet for long"


@pytest.mark.cluster
def test_a_pod_whose_process_starts_and_ends_every_cycle_gets_two_events_with_counts(
    make_world: WorldFactory, api: client.ApiClient
) -> None:
    world = make_world({"train": 1, "notebook": 1})
    # in use first: a pod whose use was never seen gets no condition to end
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="in use")
    cycles = 4
    for _ in range(cycles):
        world.write(notebook=False)
        wait_for(lambda: condition(pod(world, "notebook")).status == "False", what="ended")
        world.write(notebook=True)
        wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="again")

    def ours() -> list[dict[str, Any]]:
        raw: Any = client.EventsV1Api(api).list_namespaced_event(world.ns, _preload_content=False)
        items = json.loads(raw.data)["items"]
        return [e for e in items if e["regarding"]["name"] == "notebook"]

    def counted() -> dict[str, int]:
        return {e["reason"]: (e.get("series") or {}).get("count", 1) for e in ours()}

    wait_for(
        lambda: counted() == {"GPUUseStarted": cycles + 1, "GPUUseEnded": cycles},
        what="two Events, counting every start and end",
    )
    assert len(ours()) == 2


def test_an_event_on_a_whole_second_is_recorded_and_counted_with_its_six_digits(
    api: client.ApiClient,
) -> None:
    """A MicroTime without its fraction is refused: an Event and its series' count written on
    a whole second keep their `.000000` (as built here, not as a model would write them)."""
    counts = Counts()
    recorder = EventRecorder(EventApi(api), counts, "replica-1", COMPONENT, lambda: book)
    book = EventBook()
    regarding = client.V1ObjectReference(
        api_version="v1", kind="Pod", name=f"whole-{uuid.uuid4().hex[:6]}", namespace="default"
    )
    what = PodEvent("GPUUseStarted", "started using GPUs")
    recorder.record("default", regarding, what, "started using GPUs", T0)
    recorder.record("default", regarding, what, "started using GPUs", T0 + timedelta(seconds=1))
    assert counts.events == 2, "created, then counted in its series"
    raw: Any = client.EventsV1Api(api).list_namespaced_event("default", _preload_content=False)
    (event,) = [
        e for e in json.loads(raw.data)["items"] if e["regarding"]["name"] == regarding.name
    ]
    assert event["eventTime"] == "2026-11-25T12:00:00.000000Z"
    assert event["series"] == {"count": 2, "lastObservedTime": "2026-11-25T12:00:01.000000Z"}
    assert event["reportingController"] == COMPONENT
    client.EventsV1Api(api).delete_namespaced_event(event["metadata"]["name"], "default")
