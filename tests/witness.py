"""A witness of what the product writes on pods while faults come and go: it watches the pods
and Events of one namespace from its own thread (re-listing whenever a watch breaks, as an
apiserver restart breaks it) and keeps every GPUInUse condition and GPU Event it saw, so that
a test can count the wrong marks of a whole fault, not only the state at its end."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from gpuusage.api import names

MISUSE = frozenset({"UsingUnrequestedGPU", "UsingUnallocatedGPU"})
"""The condition reasons that flag a pod's use."""


@dataclass(frozen=True)
class Seen:
    """One GPUInUse condition the witness saw on a pod."""

    pod: str
    uid: str
    status: str
    reason: str


@dataclass
class Witness:
    """Watches `namespace` through `api` until `stop`; `conditions` and `events` grow."""

    api: client.ApiClient
    namespace: str
    conditions: list[Seen] = field(default_factory=list)
    events: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    """Event name → (pod UID, reason, count: 1, or the series' count)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Witness:
        for follow in (self._pods, self._events):
            thread = threading.Thread(target=self._forever, args=(follow,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _forever(self, follow: Any) -> None:
        while not self._stop.is_set():
            try:
                follow()
            except Exception:  # the apiserver went away, the watch expired: list and watch again
                self._stop.wait(0.5)

    def _pods(self) -> None:
        self._list_and_watch(client.CoreV1Api(self.api).list_namespaced_pod, self._saw_pod)

    def _list_and_watch(self, lister: Any, saw: Any) -> None:
        """What `lister` lists in the namespace, then each change from that version on. Read
        raw: the kubelet's and scheduler's Events have no eventTime, which the client's
        events.k8s.io model refuses."""
        raw: Any = lister(self.namespace, _preload_content=False)
        listed = json.loads(raw.data)
        for item in listed["items"]:
            saw(item)
        changes = lister(
            self.namespace,
            watch=True,
            resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=20,
            _preload_content=False,
        )
        self._follow(changes, saw)

    def _saw_pod(self, pod: dict[str, Any]) -> None:
        conditions = (pod.get("status") or {}).get("conditions") or []
        for c in conditions:
            if c.get("type") == names.POD_CONDITION_GPU_IN_USE:
                seen = Seen(
                    pod["metadata"]["name"],
                    pod["metadata"]["uid"],
                    str(c.get("status")),
                    str(c.get("reason")),
                )
                with self._lock:
                    if not self.conditions or self.conditions[-1] != seen:
                        self.conditions.append(seen)

    def _events(self) -> None:
        events = client.EventsV1Api(self.api)
        self._list_and_watch(events.list_namespaced_event, self._saw_event)

    def mark(self) -> int:
        """Where the record stands now: `since` tells what was seen after it."""
        with self._lock:
            return len(self.conditions)

    def since(self, mark: int) -> list[Seen]:
        """The pods' conditions seen since `mark`."""
        with self._lock:
            return self.conditions[mark:]

    def reasons(self, uid: str) -> list[str]:
        """The reasons of the pod's GPU Events, a series counted once."""
        with self._lock:
            return sorted(reason for who, reason, _ in self.events.values() if who == uid)

    def _follow(self, changes: Any, saw: Any) -> None:
        """Each change of a raw watch stream, until it ends (its timeout, the apiserver gone)
        or the witness stops; an ERROR (the version expired) ends it for a new list."""
        try:
            for line in changes:  # urllib3 gives the stream line by line: a change each
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                change = json.loads(line)
                if change.get("type") == "ERROR":
                    return
                saw(change["object"])
        finally:
            changes.release_conn()

    def _saw_event(self, event: dict[str, Any]) -> None:
        reason = str(event.get("reason"))
        if not reason.startswith("GPU") and reason not in MISUSE:
            return
        regarding = event.get("regarding") or {}
        count = int((event.get("series") or {}).get("count", 1))
        with self._lock:
            self.events[event["metadata"]["name"]] = (str(regarding.get("uid")), reason, count)

    # -- what a test asks ---------------------------------------------------------------------
    def wrong_marks(self, uses: dict[str, str], running: set[str]) -> list[str]:
        """Every wrong mark seen so far. `uses`: pod UID → the condition reason its use
        deserves (ProcessesRunning, or a misuse reason); `running`: the UIDs of pods that ran
        all along. A running pod's condition never False, never another reason than its own
        while True (Unknown says what is not known: allowed); no GPUUseEnded for it; at most
        one GPUUseStarted Event, counted once; its misuse flagged once, and only its own."""
        wrong = []
        with self._lock:
            conditions = list(self.conditions)
            events = list(self.events.values())
        for seen in conditions:
            if seen.uid not in running:
                continue
            if seen.status == "False":
                wrong.append(f"{seen.pod} marked {seen.status} {seen.reason}")
            elif seen.status == "True" and seen.reason != uses[seen.uid]:
                wrong.append(f"{seen.pod} marked {seen.reason}, not {uses[seen.uid]}")
        for uid in running:
            reasons = [(reason, count) for who, reason, count in events if who == uid]
            started = [count for reason, count in reasons if reason == "GPUUseStarted"]
            if len(started) > 1 or sum(started) > 1:
                wrong.append(f"pod {uid}: GPUUseStarted {len(started)} times, counted {started}")
            if any(reason == "GPUUseEnded" for reason, _ in reasons):
                wrong.append(f"pod {uid}: GPUUseEnded while it ran")
            flags = [(reason, count) for reason, count in reasons if reason in MISUSE]
            if any(reason != uses[uid] for reason, _ in flags):
                wrong.append(f"pod {uid}: flagged {flags}, its use is {uses[uid]}")
            if sum(count for _, count in flags) > 1:
                wrong.append(f"pod {uid}: flagged again after the fault {flags}")
        return wrong

    def last(self, uid: str) -> Seen | None:
        """The last condition seen on the pod."""
        with self._lock:
            found = [s for s in self.conditions if s.uid == uid]
        return found[-1] if found else None
