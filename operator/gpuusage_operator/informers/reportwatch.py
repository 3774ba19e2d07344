"""The GpuNodeUsage reports, kept by our own list-then-watch (see informer for the semantics):
the cache a worker reads a report from when it takes the report's name (a lister, as
client-go's), never a body handed along with an event nor a GET.

Why not kopf's watch: kopf queued every report's parsed body for its handler at start, all of
them at once, and the allocator kept that peak (benchmarks/README.md, "Operator: where its
memory goes"). Here each report is kept as its compact JSON text, compressed, and parsed only
when a worker reconciles it: the parsed form lives for one reconcile.

What the watch hears becomes names in the work queue, as client-go's event handlers do:
a report added, changed or deleted is queued (unless the change is the echo of our own status
write); a list queues every report it finds changed or gone since the state it replaces, all
of them at the first list (client-go's Replace).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuusage.api import names
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import WATCH_IDLE, Informer, watch_kwargs

_UNKEPT = ("managedFields",)
"""Metadata a reconcile never reads: the field managers' record is most of a small object's
metadata."""


def _compact(report: Mapping[str, Any]) -> bytes:
    """The report as kept: compact JSON, compressed (a report's status and spec repeat their
    keys, so it shrinks much, and reads back fast)."""
    meta = {k: v for k, v in (report.get("metadata") or {}).items() if k not in _UNKEPT}
    text = json.dumps({**report, "metadata": meta}, separators=(",", ":"))
    return zlib.compress(text.encode(), 1)


@dataclass
class ReportStore:
    """Report name → its latest body as compressed compact JSON. `on_change` hears a report added or
    modified (with the object, to tell our own echo); `on_delete`, a report deleted. A state
    being listed has neither (the informer compares the states instead, see `changed`): they
    are set once it replaces the old state, for the watch that follows."""

    on_change: Callable[[str, Mapping[str, Any]], None] = lambda name, report: None
    on_delete: Callable[[str], None] = lambda name: None
    bodies: dict[str, bytes] = field(default_factory=dict)

    def apply(self, event_type: str, report: Mapping[str, Any]) -> None:
        name = (report.get("metadata") or {}).get("name")
        if not name:
            return
        if event_type == "DELETED":
            if self.bodies.pop(name, None) is not None:
                self.on_delete(name)
            return
        self.bodies[name] = _compact(report)
        self.on_change(name, report)

    def get(self, name: str) -> dict[str, Any] | None:
        """A report's latest body, parsed afresh (the caller's to keep or change)."""
        data = self.bodies.get(name)
        return None if data is None else dict(json.loads(zlib.decompress(data)))

    def changed(self, before: ReportStore) -> set[str]:
        """The reports that differ from `before`: new, changed or gone."""
        old, new = before.bodies, self.bodies
        return {n for n in old.keys() | new.keys() if old.get(n) != new.get(n)}

    def ids(self) -> set[str]:
        return set(self.bodies)

    def __len__(self) -> int:
        return len(self.bodies)


class ReportWatch(Informer[ReportStore]):
    """The report informer: `get(name)` is the lister. `on_event` hears (name, the object or
    None when deleted) for each change the watch shows; `on_listed` hears the names a list
    found changed or gone (every name at the first list)."""

    def __init__(
        self,
        custom: Any,
        *,
        on_event: Callable[[str, Mapping[str, Any] | None], None] = lambda name, report: None,
        on_listed: Callable[[set[str]], None] = lambda names: None,
        health: ApiHealth | None = None,
        retry_seconds: float = 1.0,
        wait: Callable[[float], bool] | None = None,
        idle_timeout: float = WATCH_IDLE,
    ) -> None:
        def listed(before: ReportStore, after: ReportStore) -> None:
            after.on_change = on_event
            after.on_delete = lambda name: on_event(name, None)
            on_listed(after.changed(before))

        super().__init__(
            "report",
            lambda limit, token: custom.list_cluster_custom_object(
                names.GROUP,
                names.VERSION,
                names.PLURAL,
                limit=limit,
                _continue=token,
                _preload_content=False,
            ),
            lambda version, idle: custom.list_cluster_custom_object(
                names.GROUP, names.VERSION, names.PLURAL, **watch_kwargs(version, idle)
            ),
            ReportStore,
            retry_seconds=retry_seconds,
            wait=wait,
            health=health,
            on_listed=listed,
            idle_timeout=idle_timeout,
        )

    def get(self, name: str) -> dict[str, Any] | None:
        """The report as the watch last showed it; None: there is none (once synced)."""
        return self.state.get(name)

    def names(self) -> set[str]:
        return self.state.ids()
