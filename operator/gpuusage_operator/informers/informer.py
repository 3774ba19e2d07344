"""List then watch one kind of object into an in-memory state, as client-go's informers do.

Semantics (the pod index's, see informers.podwatch, and the DRA indexes', see informers.drawatch):

* `synced` is set once a full list is in; readers wait for it, so nothing is ever resolved
  against a half-built or outdated state.
* A watch that ends cleanly (its server-side timeout) resumes from the last resourceVersion
  (bookmarks keep it fresh). Any interruption (the API away, a 410 Gone, a broken stream)
  clears `synced` and lists again, as client-go's reflector does: objects may have been deleted
  and recreated meanwhile. The new state replaces the old one in one assignment.
* Retries back off (doubling up to MAX_RETRY, jittered) and the backoff starts over after
  every successful list, so once the API is back the state is whole again within one short
  retry, however long the outage was.
* Lines are parsed as plain JSON (no model objects) and handed to the state at once; a list
  page's items are parsed one at a time (raw.list_items), and the memory a list freed is given
  back to the system (see memory).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import closing
from typing import Any, Generic, Protocol, TypeVar

from gpuusage import memory
from gpuusage.kube import raw
from gpuusage.kube.config import CONNECT_TIMEOUT
from gpuusage.kube.errors import Forbidden, NotFound, translate
from gpuusage.retry import doubling
from gpuusage_operator.informers.apihealth import ApiHealth

log = logging.getLogger(__name__)

PAGE = 500
WATCH_SECONDS = 300
WATCH_IDLE = 150.0
"""Seconds a watch may receive nothing, not even a bookmark, before its connection is taken
for dead (a peer gone without closing it, a dropped NAT entry) and the state listed again.
Measured on kube-apiserver v1.34.4: a quiet watch that asks for bookmarks gets its first
after about 120 s, then one every 61 s."""
MAX_RETRY = 5.0


class State(Protocol):
    """What an informer keeps: objects applied one event at a time."""

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None: ...

    def ids(self) -> set[str]: ...

    def __len__(self) -> int: ...


S = TypeVar("S", bound=State)

ListPage = Callable[[int, str | None], Any]
"""(limit, continue token) → the raw response of one page of the list."""
WatchFrom = Callable[[str, float], Any]
"""(resourceVersion, idle timeout) → the raw response of a watch stream from there."""


class WatchExpired(Exception):
    """The watch cannot resume from its resourceVersion (410 Gone, or another watch error)."""


class Informer(Generic[S]):
    """Keeps a state current from the API; run() blocks, so it runs in a thread.

    `wait(seconds)` pauses between retries and returns True when the loop should stop; tests
    inject one to see the backoff without sleeping. `on_listed` hears every list, with the
    state it replaced (empty at the first) and the new one, before `synced` is set: what
    changed while no watch was open (objects gone, changed, new) is told from the two
    (client-go's Replace); a watch's events, DELETED too, are the state's own to tell.
    """

    def __init__(
        self,
        what: str,
        list_page: ListPage,
        watch_from: WatchFrom,
        new_state: Callable[[], S],
        *,
        retry_seconds: float = 1.0,
        wait: Callable[[float], bool] | None = None,
        health: ApiHealth | None = None,
        on_listed: Callable[[S, S], None] = lambda before, after: None,
        idle_timeout: float = WATCH_IDLE,
        trim: Callable[[], object] = memory.trim,
    ) -> None:
        self.what = what
        self._trim = trim
        self.idle_timeout = idle_timeout
        self._list_page, self._watch_from, self._new_state = list_page, watch_from, new_state
        self._health = health or ApiHealth()
        self._on_listed = on_listed
        self.state: S = new_state()
        self._backoff = doubling(retry_seconds, MAX_RETRY)
        self.writing = threading.Lock()
        """Held by every writer of `state` (the loop, and callers that read an object again)."""
        self.synced = threading.Event()
        self.stopped = threading.Event()
        self._wait = wait or self.stopped.wait
        self.relists = 0
        self._stream: Any = None  # the watch response being read, for stop()
        self._asked = 0  # lists asked for by relist()
        self._listed_for = 0  # the latest of them a list began after

    def __len__(self) -> int:
        return len(self.state)

    def run(self) -> None:
        version: str | None = None
        failures = 0
        while not self.stopped.is_set():
            watching = False
            try:
                while version is None or self._listed_for != self._asked:
                    version = self.list_all()
                    failures = 0  # reconnected: the next outage starts its backoff afresh
                watching = True
                version = self._watch(version)
            except Exception as exc:  # the API is away, or the watch cannot resume: list again
                if self.stopped.is_set():
                    break  # shutting down, perhaps with the control plane: nothing to report
                self.synced.clear()  # readers wait for the new list
                version = None
                if watching and self._listed_for != self._asked:
                    continue  # relist() ended the watch: no fault
                if isinstance(exc, WatchExpired):
                    log.info("%s watch expired (%s); listing again", self.what, exc)
                    continue
                delay = self._backoff.delay(failures) or MAX_RETRY
                failures += 1
                self._health.failed(f"{self.what} watch", exc)
                log.warning(
                    "%s watch interrupted: %s (listing again in %.1fs)", self.what, exc, delay
                )
                if self._wait(delay):
                    break

    def stop(self) -> None:
        """Stop the loop, and end the watch it may be blocked in: an open watch would keep the
        thread, and the apiserver's shutdown, waiting for up to WATCH_SECONDS."""
        self.stopped.set()
        stream = self._stream
        if stream is not None:
            raw.shutdown(stream)

    def relist(self) -> None:
        """List everything again before the state counts as synced: what the watch has not
        brought yet is in a list begun now (a new leader's view of what the last one wrote).
        Readers see `synced` cleared at once; the loop ends its watch and lists."""
        with self.writing:
            self._asked += 1
            self.synced.clear()
        stream = self._stream
        if stream is not None:
            raw.shutdown(stream)

    def list_all(self) -> str:
        """List every object (paginated) into a new state that replaces the old one; the
        list's resourceVersion, for the watch to resume from. A relist() asked for while it
        ran leaves `synced` clear: the loop lists again."""
        asked = self._asked
        state = self._new_state()
        token: str | None = None
        while True:
            fields: dict[str, Any] = {}
            for obj in raw.list_items(raw.body(self._list_page(PAGE, token)), fields):
                state.apply("ADDED", obj)
            meta = fields.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        with self.writing:
            before = self.state
            self.state = state  # one assignment: readers see the old state or the new one
        self._trim()  # the pages read, and the state replaced, are freed: see memory
        self.relists += 1
        self._health.succeeded()
        self._on_listed(before, state)
        again = "synced" if self.relists == 1 else "listed again"
        log.info("%s index %s: %d objects", self.what, again, len(state))
        with self.writing:
            self._listed_for = asked
            if asked == self._asked:
                self.synced.set()
        return str(meta.get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        response = self._watch_from(version, self.idle_timeout)
        self._stream = response
        if self.stopped.is_set() or self._listed_for != self._asked:
            raw.shutdown(response)  # stop() or relist() came between the check and the request
        try:
            return self._events(response, version)
        finally:
            self._stream = None  # ended: nothing for stop() or relist() to end any more

    def _events(self, response: Any, version: str) -> str:
        with closing(raw.json_lines(response)) as events:  # closed now, however it is left
            for event in events:
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code, reason, message = obj.get("code"), obj.get("reason"), obj.get("message")
                    raise WatchExpired(f"{code} {reason}: {message}")
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    with self.writing:
                        self.state.apply(str(kind), obj)
                if self.stopped.is_set():
                    break
        return version


def watch_kwargs(version: str, idle: float = WATCH_IDLE) -> dict[str, Any]:
    """The arguments of a watch call, the same for every kind: bookmarks asked for, so that a
    quiet watch still hears from the server, and a read timeout of `idle` seconds."""
    return {
        "watch": True,
        "resource_version": version,
        "allow_watch_bookmarks": True,
        "timeout_seconds": WATCH_SECONDS,
        "_preload_content": False,
        "_request_timeout": (CONNECT_TIMEOUT, idle),
    }


class OptionalWatch:
    """Informers for an API the cluster may not serve, or the operator may not read (DRA, the
    agents' Leases): `start` asks once with `probe` (one small list call). A 404 or a 403 says
    it cannot be read, for good (an operator restart picks up a new API or new permissions):
    `unavailable` is logged once, with the error, and nothing is watched. Other errors are the
    informers' to retry. `synced` holds once that is decided and, when watched, listed."""

    def __init__(
        self, informers: list[Informer[Any]], probe: Callable[[], Any], unavailable: str
    ) -> None:
        self.informers = informers
        self._probe = probe
        self._unavailable = unavailable
        self.available = threading.Event()
        self.decided = threading.Event()
        """Set once it is known whether the API can be read (then `available` says)."""

    def probe(self) -> bool:
        try:
            raw.body(self._probe())  # read to its end: see raw.body
        except Exception as exc:
            error = translate(exc)
            if isinstance(error, NotFound | Forbidden):
                log.warning(self._unavailable, error)
                return False
        return True

    def start(self) -> None:
        if self.probe():
            self.available.set()
            for informer in self.informers:
                threading.Thread(target=informer.run, name=informer.what, daemon=True).start()
        self.decided.set()

    def stop(self) -> None:
        for informer in self.informers:
            informer.stop()

    @property
    def synced(self) -> bool:
        return self.decided.is_set() and (
            not self.available.is_set() or all(i.synced.is_set() for i in self.informers)
        )
