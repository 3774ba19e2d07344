"""The pod index, kept by our own list-then-watch of all pods (an informer, as client-go has).

Why not a kopf index: kopf 1.45 holds every resource handler until every object of every
indexed resource has been indexed, and it does so with one toggle per object in a set that
every waiting worker re-scans on every change. At 5,000 pods that startup took more than three
minutes of CPU and 254 MB before the first report was handled (benchmarks/README.md). This
watch is linear: one paginated list, then one watch stream from the list's resourceVersion,
each line parsed as plain JSON (no model objects) and reduced to a PodRef at once.

Semantics, as an informer's:

* `synced` is set once the first full list is in; reconciles wait for it, so no report is ever
  resolved against a half-built index.
* A broken stream resumes from the last resourceVersion (bookmarks keep it fresh); a 410 Gone
  or any other watch error lists again, and the new index replaces the old one at once, which
  drops pods deleted while the watch was down.
* Readers get consistent snapshots without locks: every change replaces the small per-key
  mapping instead of mutating it, and a relist swaps the whole state in one assignment.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuusage.kube import raw
from gpuusage.operator.podindex import PodLookup, PodRef, index_keys

log = logging.getLogger(__name__)

PAGE = 500
WATCH_SECONDS = 300


@dataclass
class IndexState:
    """uid → the keys it is indexed under; key → {uid: PodRef}."""

    keys_of: dict[str, tuple[str, ...]] = field(default_factory=dict)
    by_key: dict[str, dict[str, PodRef]] = field(default_factory=dict)

    def put(self, uid: str, keys: Mapping[str, PodRef]) -> None:
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
    """Keeps an IndexState current from the API; run() blocks, so it runs in a thread."""

    def __init__(self, core: Any, retry_seconds: float = 1.0) -> None:
        self._core = core  # kubernetes.client.CoreV1Api
        self._state = IndexState()
        self._retry = retry_seconds
        self.synced = threading.Event()
        self.stopped = threading.Event()
        self.relists = 0

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
                    version = self._list()
                version = self._watch(version)
                failures = 0
            except WatchExpired as exc:
                log.info("pod watch expired (%s); listing again", exc)
                version = None
            except Exception as exc:  # the API is away: resume from where we were
                if self.stopped.is_set():
                    break  # shutting down, perhaps with the control plane: nothing to report
                failures += 1
                delay = min(30.0, self._retry * 2 ** min(failures, 5)) * random.uniform(0.5, 1)
                log.warning("pod watch interrupted: %s (retry in %.1fs)", exc, delay)
                self.stopped.wait(delay)

    def stop(self) -> None:
        self.stopped.set()

    def _list(self) -> str:
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
        self._state = state  # one assignment: readers see the old index or the new one
        self.relists += 1
        if not self.synced.is_set():
            log.info("pod index synced: %d pods", len(state))
        self.synced.set()
        return str(meta.get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        response = self._core.list_pod_for_all_namespaces(
            watch=True, resource_version=version, allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS, _preload_content=False,
        )  # fmt: skip
        for event in raw.json_lines(response):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise WatchExpired(f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self._state.apply(str(kind), obj)
            if self.stopped.is_set():
                break
        return version
