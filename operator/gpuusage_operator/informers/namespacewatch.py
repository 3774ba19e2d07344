"""The namespaces' labels and opt-out, kept by one informer: what the policies' namespace
selectors and the operator's own scope (--namespace-selector) read, never a read per pod.

Watched whether or not the policies are served, so that the scope holds in an install without
them. `on_change` hears when a namespace already known changes its labels or opt-out, and
when the namespaces are listed (which policy covers a namespace's pods, and whether the
operator writes on them, may have changed: a report judged before the first list left its
pods as they were).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import WATCH_IDLE, Informer, watch_kwargs
from gpuusage_operator.policies.select import exempt


@dataclass(frozen=True)
class NamespaceFacts:
    labels: Mapping[str, str]
    exempt: bool


class NamespaceState:
    """Each namespace's labels and opt-out."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.namespaces: dict[str, NamespaceFacts] = {}
        self._on_change = on_change

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if event_type == "DELETED":
            self.namespaces.pop(name, None)
            return
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        facts = NamespaceFacts(labels, exempt(meta.get("annotations")))
        known = self.namespaces.get(name)
        self.namespaces[name] = facts
        if known is not None and known != facts:
            self._on_change()

    def ids(self) -> set[str]:
        return set(self.namespaces)

    def __len__(self) -> int:
        return len(self.namespaces)


def namespace_informer(
    core: Any,
    *,
    health: ApiHealth | None = None,
    on_change: Callable[[], None] = lambda: None,
    idle_timeout: float = WATCH_IDLE,
) -> Informer[NamespaceState]:
    """The namespaces' informer on `core` (a CoreApi)."""
    return Informer(
        "namespace",
        lambda limit, token: core.list_namespace(
            limit=limit, _continue=token, _preload_content=False
        ),
        lambda version, idle: core.list_namespace(**watch_kwargs(version, idle)),
        lambda: NamespaceState(on_change),
        health=health,
        on_listed=lambda before, after: on_change(),
        idle_timeout=idle_timeout,
    )
