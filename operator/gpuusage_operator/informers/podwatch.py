"""The pod index, kept by our own list-then-watch of all pods (see informer for the semantics).

Why not a kopf index: kopf 1.45 holds every resource handler until every object of every
indexed resource has been indexed, and it does so with one toggle per object in a set that
every waiting worker re-scans on every change, so its startup grew with the square of the
pods before the first report was handled (benchmarks/README.md). This watch is linear: one
paginated list, then one watch stream, each pod reduced to a PodSnapshot at once.

Readers take no lock: a lookup reads the live maps, in which each change puts a pod's new
record (immutable) before it removes the old one, so a reader sees a pod's old record or its
new one, never neither; a relist swaps the whole state in one assignment. A lookup is no
snapshot: two reads of one lookup may see different moments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuusage.kube import raw
from gpuusage_operator.index.keptpods import KeptPods
from gpuusage_operator.index.podpack import PlainPods, packable
from gpuusage_operator.index.pods import PodLookup, PodSnapshot, requesting_node, snapshot_of
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import WATCH_IDLE, Informer, watch_kwargs
from gpuusage_operator.judge.requests import DEFAULT_RULES, AllocationRules


@dataclass
class IndexState:
    """Pods kept whole (see index.keptpods), and plain pods (see index.podpack) packed under
    their UID alone.

    The hooks hear the changes the watch reports (MODIFIED, DELETED), and from a list again
    only what differs from the state it replaces (see PodWatch), never the first list, which
    would make every node due; each is told once the index shows the change, so that a
    worker that acts on it reads the pod as it is now."""

    rules: AllocationRules = DEFAULT_RULES
    on_requesting: Callable[[set[str]], None] = lambda nodes: None
    """Hears the nodes a pod started or stopped holding GPUs on (running with an allocation):
    what their reports list as handed changed, with no event of the reports' own."""
    on_marks: Callable[[PodSnapshot], None] = lambda pod: None
    """Hears a pod whose gpuusage.io/ annotations or GPUInUse condition changed: what it
    carries is compared with what it should carry without waiting for a report."""
    on_gone: Callable[[str, str], None] = lambda node, uid: None
    """Hears a deleted pod that was on a node: (node, UID)."""

    kept: KeptPods = field(default_factory=KeptPods)
    plain: PlainPods = field(default_factory=PlainPods)

    def remove(self, uid: str) -> None:
        if not self.plain.remove(uid):
            self.kept.remove(uid)

    def get(self, uid: str) -> PodSnapshot | None:
        return self.kept.get(uid) or self.plain.get(uid)

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) for one pod object."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        old = self.get(uid) if event_type != "ADDED" else None
        if event_type == "DELETED":
            self.remove(uid)
            node = (old.node if old else None) or (pod.get("spec") or {}).get("nodeName")
            if node:
                self.on_gone(str(node), uid)
            return
        new = snapshot_of(pod, self.rules)
        if new is None:
            return
        # Put where it now belongs before leaving where it was: readers never miss it.
        if packable(new, pod):
            self.plain.put(new)
            self.kept.remove(uid)
        else:
            self.kept.put(new)
            self.plain.remove(uid)
        if event_type == "MODIFIED":
            nodes, marked = _difference(old, new)
            if nodes:
                self.on_requesting(nodes)
            if marked:
                self.on_marks(new)

    def lookup(self) -> PodLookup:
        return PodLookup(self.kept, self.plain)

    def ids(self) -> set[str]:
        return self.kept.uids() | self.plain.uids()

    def __len__(self) -> int:
        return len(self.kept) + len(self.plain)


def _marks(pod: PodSnapshot) -> tuple[object, ...]:
    return pod.annotations, pod.condition


def _difference(old: PodSnapshot | None, new: PodSnapshot) -> tuple[set[str], bool]:
    """What a pod's change from `old` (None: not known before) to `new` tells the hooks: the
    nodes it started or stopped holding GPUs on, or whose running pod's allocation changed (a
    claim named in its status), and whether its gpuusage.io/ marks changed."""
    was, now = requesting_node(old), requesting_node(new)
    nodes = {node for node in (was, now) if node} if was != now else set()
    if now and was == now and old is not None and old.claimed != new.claimed:
        nodes = {now}
    return nodes, old is not None and _marks(old) != _marks(new)


def _changes(
    before: IndexState,
    after: IndexState,
    on_requesting: Callable[[set[str]], None],
    on_marks: Callable[[PodSnapshot], None],
    on_gone: Callable[[str, str], None],
) -> None:
    """Tell the hooks what differs between two states, pod by pod, as the watch's events would
    have: the pods gone (with the node `before` had them on), the nodes pods started or stopped
    holding GPUs on (pods new to `after` included), the pods whose marks changed."""
    for uid in before.ids() - after.ids():
        ref = before.get(uid)
        if ref is not None and ref.node:
            on_gone(ref.node, uid)
    nodes: set[str] = set()
    for uid in after.ids():
        new = after.get(uid)
        if new is None:
            continue
        moved, marked = _difference(before.get(uid), new)
        nodes |= moved
        if marked:
            on_marks(new)
    if nodes:
        on_requesting(nodes)


class PodWatch(Informer[IndexState]):
    """The pod informer, with the lookups and the one-pod refresh the reconciler needs."""

    def __init__(
        self,
        core: Any,
        retry_seconds: float = 1.0,
        wait: Callable[[float], bool] | None = None,
        *,
        health: ApiHealth | None = None,
        on_gone: Callable[[str, str], None] = lambda node, uid: None,
        on_requesting: Callable[[set[str]], None] = lambda nodes: None,
        on_marks: Callable[[PodSnapshot], None] = lambda pod: None,
        rules: AllocationRules = DEFAULT_RULES,
        idle_timeout: float = WATCH_IDLE,
    ) -> None:
        """The hooks are IndexState's; they also hear what a list again finds changed since the
        state it replaces, as the watch would have told it (client-go's Replace), the pods gone
        while the watch was interrupted included; the first list tells nothing."""

        def replaced(before: IndexState, after: IndexState) -> None:
            if self.relists > 1:
                _changes(before, after, on_requesting, on_marks, on_gone)

        self._core = core  # kubernetes.client.CoreV1Api
        super().__init__(
            "pod",
            lambda limit, token: core.list_pod_for_all_namespaces(
                limit=limit, _continue=token, _preload_content=False
            ),
            lambda version, idle: core.list_pod_for_all_namespaces(**watch_kwargs(version, idle)),
            lambda: IndexState(
                rules=rules, on_requesting=on_requesting, on_marks=on_marks, on_gone=on_gone
            ),
            retry_seconds=retry_seconds,
            wait=wait,
            health=health,
            on_listed=replaced,
            idle_timeout=idle_timeout,
        )

    def lookup(self) -> PodLookup:
        return self.state.lookup()

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
        with self.writing:
            self.state.remove(stale_uid)
            for found in page.get("items") or []:
                self.state.apply("ADDED", found)
