"""The pod index, kept by our own list-then-watch of all pods (an informer, as client-go has).

Why not a kopf index: kopf 1.45 holds every resource handler until every object of every
indexed resource has been indexed, and it does so with one toggle per object in a set that
every waiting worker re-scans on every change. At 5,000 pods that startup took more than three
minutes of CPU and 254 MB before the first report was handled (benchmarks/README.md). This
watch is linear: one paginated list, then one watch stream from the list's resourceVersion,
each line parsed as plain JSON (no model objects) and reduced to a PodSnapshot at once.

Semantics, as an informer's:

* `synced` is set once a full list is in; reconciles wait for it, so no report is ever
  resolved against a half-built or outdated index.
* A watch that ends cleanly (its server-side timeout) resumes from the last resourceVersion
  (bookmarks keep it fresh). Any interruption (the API away, a 410 Gone, a broken stream)
  clears `synced` and lists again, as client-go's reflector does: while the watch was down,
  pods may have been deleted and recreated under the same name, and until the new list is in,
  reports wait rather than being resolved against what the index showed before. The new index
  replaces the old one at once, which drops pods deleted meanwhile.
* Retries back off (1, 2, 4 s, at most `MAX_RETRY`, with jitter) and the backoff starts over
  after every successful list, so once the API is back the index is whole again within one
  short retry, however long the outage was.
* Readers get consistent snapshots without locks: every change replaces the small per-key
  mapping instead of mutating it, and a relist swaps the whole state in one assignment.
  Writers (the watch thread, and `refresh` from the reconcilers) take a lock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuusage.kube import raw
from gpuusage.retry import doubling
from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.podindex import PodLookup, PodSnapshot, index_keys

log = logging.getLogger(__name__)

PAGE = 500
WATCH_SECONDS = 300
MAX_RETRY = 5.0


@dataclass
class IndexState:
    """uid → the keys it is indexed under; key → {uid: PodSnapshot}."""

    keys_of: dict[str, tuple[str, ...]] = field(default_factory=dict)
    by_key: dict[str, dict[str, PodSnapshot]] = field(default_factory=dict)

    def put(self, uid: str, keys: Mapping[str, PodSnapshot]) -> None:
        self.remove(uid)
        for key, ref in keys.items():
            self.by_key[key] = {**self.by_key.get(key, {}), uid: ref}
        if keys:
            self.keys_of[uid] = tuple(keys)

    def remove(self, uid: str) -> None:
        for key in self.keys_of.pop(uid, ()):
            rest = {u: r for u, r in self.by_key.get(key, {}).items() if u != uid}
            if rest:
                self.by_key[key] = rest
            else:
                self.by_key.pop(key, None)

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) for one pod object."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        if event_type == "DELETED":
            self.remove(uid)
        else:
            self.put(uid, index_keys(pod))

    def __len__(self) -> int:
        return len(self.keys_of)


class WatchExpired(Exception):
    """The watch cannot resume from its resourceVersion (410 Gone, or another watch error)."""


class PodWatch:
    """Keeps an IndexState current from the API; run() blocks, so it runs in a thread.

    `wait(seconds)` pauses between retries and returns True when the watch should stop; tests
    inject one to see the backoff without sleeping.
    """

    def __init__(
        self,
        core: Any,
        retry_seconds: float = 1.0,
        wait: Callable[[float], bool] | None = None,
        *,
        health: ApiHealth | None = None,
        on_deleted: Callable[[set[str]], None] = lambda uids: None,
    ) -> None:
        self._core = core  # kubernetes.client.CoreV1Api
        self._health = health or ApiHealth()
        self._on_deleted = on_deleted
        self._state = IndexState()
        self._backoff = doubling(retry_seconds, MAX_RETRY)
        self._writing = threading.Lock()
        self.synced = threading.Event()
        self.stopped = threading.Event()
        self._wait = wait or self.stopped.wait
        self.relists = 0
        self.refreshes = 0
        self._stream: Any = None  # the watch response being read, for stop()
        self.watching = threading.Event()
        """Set while a watch stream is open (after each list, until it ends)."""

    def lookup(self) -> PodLookup:
        return PodLookup(self._state.by_key)

    def __len__(self) -> int:
        return len(self._state)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        version: str | None = None
        failures = 0
        while not self.stopped.is_set():
            try:
                if version is None:
                    version = self.list_all()
                    failures = 0  # reconnected: the next outage starts its backoff afresh
                version = self._watch(version)
            except Exception as exc:  # the API is away, or the watch cannot resume: list again
                if self.stopped.is_set():
                    break  # shutting down, perhaps with the control plane: nothing to report
                self.synced.clear()  # reports wait for the new list
                version = None
                if isinstance(exc, WatchExpired):
                    log.info("pod watch expired (%s); listing again", exc)
                    continue
                delay = self._backoff.delay(failures) or MAX_RETRY
                failures += 1
                self._health.failed("pod watch", exc)
                log.warning("pod watch interrupted: %s (listing again in %.1fs)", exc, delay)
                if self._wait(delay):
                    break

    def stop(self) -> None:
        """Stop the loop, and end the watch it may be blocked in: an open watch would keep the
        thread, and the apiserver's shutdown, waiting for up to WATCH_SECONDS."""
        self.stopped.set()
        stream = self._stream
        if stream is not None:
            raw.shutdown(stream)

    def refresh(self, namespace: str, name: str, stale_uid: str) -> None:
        """Read one pod again, after a write for `stale_uid` was refused because the pod of
        that name now has another UID: the entry of the old pod goes, the new pod's comes in.
        One LIST by name (the operator may list pods, not get them); errors are the caller's."""
        page = json.loads(
            raw.body(
                self._core.list_namespaced_pod(
                    namespace, field_selector=f"metadata.name={name}", _preload_content=False
                )
            )
        )
        with self._writing:
            self._state.remove(stale_uid)
            for found in page.get("items") or []:
                self._state.apply("ADDED", found)
        self.refreshes += 1

    def list_all(self) -> str:
        """List every pod (paginated) into a new index that replaces the old one; the list's
        resourceVersion, for the watch to resume from."""
        state = IndexState()
        token: str | None = None
        while True:
            page = json.loads(
                raw.body(
                    self._core.list_pod_for_all_namespaces(
                        limit=PAGE, _continue=token, _preload_content=False
                    )
                )
            )
            for pod in page.get("items") or []:
                state.apply("ADDED", pod)
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        with self._writing:
            gone = set(self._state.keys_of) - set(state.keys_of)
            self._state = state  # one assignment: readers see the old index or the new one
        self.relists += 1
        self._health.succeeded()
        if gone and self.relists > 1:
            self._on_deleted(gone)
        log.info(
            "pod index %s: %d pods", "synced" if self.relists == 1 else "listed again", len(state)
        )
        self.synced.set()
        return str(meta.get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        response = self._core.list_pod_for_all_namespaces(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
        )
        self._stream = response
        self.watching.set()
        if self.stopped.is_set():  # stop() came between the check and the request
            raw.shutdown(response)
        for event in raw.json_lines(response):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise WatchExpired(f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                with self._writing:
                    self._state.apply(str(kind), obj)
                uid = (obj.get("metadata") or {}).get("uid")
                if kind == "DELETED" and uid:
                    self._on_deleted({str(uid)})
            if self.stopped.is_set():
                break
        self.watching.clear()
        return version
