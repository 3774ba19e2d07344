"""Where the operator writes on pods: its marks, its Events about pods and its policies.

`--no-pod-marks` writes on no pod at all (observe first: the reports' status, the OpenReports
and the metrics carry everything); `--namespace-selector` writes only on pods in namespaces
whose labels match. Every pod is judged and counted all the same. A pod outside carries none of
gpuusage's marks: those an earlier start wrote are taken off (see Reconciler). Pure, but for
the namespaces' labels it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from gpuusage.api import names
from gpuusage.api.models import GpuNodeUsageStatus
from gpuusage.api.policy import GpuUsagePolicySpec, LabelSelector
from gpuusage.api.selectors import selects
from gpuusage.api.times import format_time
from gpuusage_operator.index.pods import MARKED_KEY, KeptLookup, PodLookup, PodSnapshot


@dataclass(frozen=True)
class Scope:
    marks: bool = True
    """--pod-marks: whether the operator writes on pods at all."""
    selector: LabelSelector | None = None
    """--namespace-selector, parsed (None: every namespace)."""
    selector_text: str = ""
    """--namespace-selector as given, for the log."""
    labels: Callable[[str], Mapping[str, str] | None] = field(default=lambda namespace: {})
    """A namespace's labels (None: not known, the namespaces not listed yet or it is gone)."""

    def __str__(self) -> str:
        if not self.marks:
            return "pod marks off"
        return f"--namespace-selector {self.selector_text!r}" if self.selector else "every pod"

    def selected(self, namespace: str) -> bool | None:
        """Whether the namespace is in --namespace-selector's; None while it is not known (the
        namespaces are listed first: one created a moment ago), when nothing is changed on its
        pods on a guess."""
        if self.selector is None:
            return True
        labels = self.labels(namespace)
        return None if labels is None else selects(self.selector, labels)

    def writes(self, namespace: str) -> bool | None:
        """Whether the operator writes on the pods of this namespace (None: not known yet)."""
        if not self.marks:
            return False
        return self.selected(namespace)


def outside_with_marks(lookup: PodLookup, scope: Scope) -> int:
    """How many pods outside the scope still carry gpuusage's marks."""
    return sum(
        1
        for node in lookup.nodes_with_our_marks()
        for ref in lookup.on_node_with_our_marks(node)
        if scope.writes(ref.namespace) is False
    )


def mark_outside(status: GpuNodeUsageStatus, scope: Scope) -> GpuNodeUsageStatus:
    """The status with each pod outside --namespace-selector marked so (outOfScope): counted,
    not written on."""
    if scope.selector is None:
        return status
    pods = [
        p.model_copy(update={"out_of_scope": True})
        if scope.selected(p.namespace) is False and not p.out_of_scope
        else p
        for p in status.pods
    ]
    return status.model_copy(update={"pods": pods})


SHOWN_NAMESPACES = 5
"""The namespaces outside the scope a policy covers, named in its log line (then a count)."""


def unheeded(
    policies: Mapping[str, GpuUsagePolicySpec],
    namespaces: Mapping[str, Mapping[str, str]],
    scope: Scope,
) -> dict[str, str]:
    """Policy name → why its pod rules act on none of the pods it covers, or not on those of
    some namespaces (for the log: an Enforce policy that never acts is explained). With pod
    marks off no policy announces or acts on a pod (its node rules still run); outside
    --namespace-selector, on no pod there. `namespaces`: each namespace's labels."""
    said = {}
    for name, spec in sorted(policies.items()):
        if not spec.rules:
            continue  # node rules only: they act whatever the pods' scope
        if not scope.marks:
            said[name] = (
                f"policy {name}: pod marks are off (--no-pod-marks): it announces nothing and "
                "acts on no pod; its node rules still run"
            )
            continue
        outside = sorted(
            namespace
            for namespace, labels in namespaces.items()
            if scope.selected(namespace) is False and selects(spec.namespace_selector, labels)
        )
        if outside:
            shown = ", ".join(outside[:SHOWN_NAMESPACES])
            more = len(outside) - SHOWN_NAMESPACES
            said[name] = (
                f"policy {name} covers namespaces outside the operator's scope ({scope}): "
                f"{shown}{f' and {more} more' if more > 0 else ''}; it announces nothing and "
                "acts on no pod there"
            )
    return said


class JudgedMarks:
    """The kept pods as the judge is to see them (KeptLookup). The judge reads a pod's own
    marks as its memory (since when its GPUs idle, whether its marks settle, where it was last
    seen). A pod outside the scope carries none the operator keeps, or old ones it may not take
    off; a pod inside carries none yet where the operator wrote none on it so far (its marks
    just turned on, or its namespace just came into --namespace-selector). Either is seen with
    the marks it would carry (`carried`: the last reconcile's, see writers.marks.would_carry),
    else (the first reconcile of a term, or a pod whose marks a person took off) with what the
    report's last status says of it (in use: from now on; listed idle: since then), else with
    none (since its start). A pod inside
    that carries marks is seen as it is."""

    def __init__(
        self,
        kept: KeptLookup,
        scope: Scope,
        carried: Mapping[str, PodSnapshot],
        previous: GpuNodeUsageStatus | None,
        now: datetime,
    ) -> None:
        self._kept, self._scope, self._carried = kept, scope, carried
        status = previous or GpuNodeUsageStatus()
        self._idle = {p.uid: p.idle_since for p in status.idle_pods}
        self._used = {p.uid for p in status.pods}
        self._now = now

    def _seen(self, ref: PodSnapshot) -> PodSnapshot:
        writes = self._scope.writes(ref.namespace)
        if writes is None or (writes and ref.marked):
            return ref  # its own marks (or, its namespace not known yet, nothing on a guess)
        people = tuple((k, v) for k, v in ref.annotations if k not in names.OPERATOR_ANNOTATIONS)
        carried = self._carried.get(ref.uid)
        if carried is not None:
            ours = tuple((k, v) for k, v in carried.annotations if k in names.OPERATOR_ANNOTATIONS)
            return replace(ref, annotations=people + ours, condition=carried.condition)
        if ref.uid in self._idle:
            since = format_time(self._idle[ref.uid])
            return replace(ref, annotations=people, condition=_said("False", since))
        if ref.uid in self._used:
            return replace(ref, annotations=people, condition=_said("True", format_time(self._now)))
        return replace(ref, annotations=people, condition=())

    def get(self, uid: str) -> PodSnapshot | None:
        found = self._kept.get(uid)
        return None if found is None else self._seen(found)

    def under(self, key: str) -> list[PodSnapshot]:
        """The pods under the key as seen; under a node's marked key also those that carry
        none but are remembered with some (their use may have ended meanwhile)."""
        seen = [self._seen(ref) for ref in self._kept.under(key)]
        if not key.startswith(MARKED_KEY):
            return seen
        node = key[len(MARKED_KEY) :]
        found = {ref.uid: ref for ref in seen if ref.marked}
        for uid in (*self._carried, *self._used, *self._idle):
            ref = self.get(uid) if uid not in found else None
            if ref is not None and ref.node == node and ref.marked:
                found[uid] = ref
        return list(found.values())

    def all_keys(self) -> list[str]:
        return self._kept.all_keys()


def as_carried(judged: PodSnapshot, as_is: PodSnapshot | None) -> PodSnapshot:
    """The pod with the marks it carries (`as_is`, from the index), which its marks are written
    against: the judge may have seen it with marks it does not carry (JudgedMarks: the memory
    of a pod that carries none yet)."""
    return as_is if as_is is not None and judged.marked and not as_is.marked else judged


def _said(status: str, since: str) -> tuple[tuple[str, str], ...]:
    """A GPUInUse condition as far as the judge reads it: its status and since when."""
    return (
        ("lastTransitionTime", since),
        ("status", status),
        ("type", names.POD_CONDITION_GPU_IN_USE),
    )


def judged_lookup(
    lookup: PodLookup,
    scope: Scope,
    carried: Mapping[str, PodSnapshot],
    previous: GpuNodeUsageStatus | None,
    now: datetime,
) -> PodLookup:
    """The pod index as the judge is to see it (see JudgedMarks)."""
    return lookup.seen_through(lambda kept: JudgedMarks(kept, scope, carried, previous, now))
