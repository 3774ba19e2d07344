"""Events written as client-go's recorder writes them: new, joined to an identical recent one's
series, or dropped when the object's rate is spent (the decisions are eventbook's; this is the
thin edge that writes them). Best effort: a failure is logged, never raised."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from kubernetes import client

from gpuusage.api.times import format_micro_time
from gpuusage.kube import raw
from gpuusage.kube.errors import NotFound, retried
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.eventbook import EventBook, Write
from gpuusage_operator.writers.marks import PodEvent

log = logging.getLogger(__name__)


class EventCounts(Protocol):
    events: int
    events_dropped: int

    def add(self, name: str, n: int = 1) -> None:
        """Count `n` more of `name` (safe from any thread)."""


COMPONENT = "gpuusage.io/operator"
"""The operator's name in its Events (reportingController)."""
EVENT_RATE, EVENT_BURST = 20.0, 200
"""Event writes a second across the cluster once the burst is spent (client-go's recorder
allows a component far fewer per object; this bounds them all together)."""


@dataclass
class EventRecorder:
    api: Any
    """An EventApi (kube.core): the Event goes out as built here, its time with all six digits."""
    counts: EventCounts
    instance: str
    component: str
    book: Callable[[], EventBook]
    """The series and rates so far, the term's (controller.term): another replica may have
    written Events since this one last led."""
    budget: WriteBudget = field(default_factory=lambda: WriteBudget(EVENT_RATE, EVENT_BURST))
    """Event writes across all objects (a second limit, beside each object's in the book)."""
    monotonic: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def record(
        self,
        namespace: str,
        regarding: client.V1ObjectReference,
        what: PodEvent,
        note: str,
        now: datetime,
    ) -> None:
        """Write the Event, join it to an identical recent one's series, or drop it when its
        object's rate is spent (see eventbook). Best effort: a failure is logged."""
        name = str(regarding.name)
        note = note[:1024]
        subject = f"{regarding.kind}/{namespace}/{name}/{regarding.uid or ''}"
        key = (subject, what.reason, what.type, note)
        with self._lock:
            write = self.book().write_for(key, now)
            if write.kind != "drop" and not self.budget.take(self.monotonic()):
                write = Write("drop")
        if write.kind == "drop":
            self.counts.add("events_dropped")
            return
        where = f"event on {regarding.kind} {namespace}/{name}"
        try:
            if write.kind == "series" and self._series(namespace, write, now, where):
                return
            created = self._create_event(namespace, regarding, what, note, now)
            with self._lock:
                self.book().written(key, created, now)
            self.counts.add("events")
        except Exception as exc:  # an Event is best effort
            log.warning("%s not recorded: %s", where, exc)

    def _series(self, namespace: str, write: Write, now: datetime, where: str) -> bool:
        """Count one more on the series' Event; False when that Event is gone (expired)."""
        series = {"count": write.count, "lastObservedTime": format_micro_time(now)}
        try:
            retried(
                lambda: raw.body(
                    self.api.patch_namespaced_event(
                        write.name, namespace, {"series": series}, _preload_content=False
                    )
                ),
                where,
            )
        except NotFound:
            return False
        self.counts.add("events")
        return True

    def _create_event(
        self,
        namespace: str,
        regarding: client.V1ObjectReference,
        what: PodEvent,
        note: str,
        now: datetime,
    ) -> str:
        """Create the Event; its name."""
        # kubelet's naming: <object>.<time in ns, hex> (generateName may not end in '.').
        # Several Events of one object in one reconcile share `now`: the sequence tells them
        # apart (one name twice is refused as AlreadyExists, and the Event lost).
        stamp = int(now.timestamp() * 1e9) + next(self._seq)
        name = f"{regarding.name}.{stamp:x}"[:253]
        event = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": format_micro_time(now),
            "action": "GPUUse",
            "reason": what.reason,
            "note": note,
            "type": what.type,
            "regarding": regarding,
            "reportingController": self.component,
            "reportingInstance": self.instance[:128],
        }
        retried(
            lambda: raw.body(
                self.api.create_namespaced_event(namespace, event, _preload_content=False)
            ),
            f"event on {regarding.kind} {namespace}/{regarding.name}",
        )
        return name
