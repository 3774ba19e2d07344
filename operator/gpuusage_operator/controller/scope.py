"""Where the operator writes on pods: its marks, its Events about pods and its policies.

`--no-pod-marks` writes on no pod at all (observe first: the reports' status, the OpenReports
and the metrics carry everything); `--namespace-selector` writes only on pods in namespaces
whose labels match. Every pod is judged and counted all the same. A pod outside carries none of
gpuusage's marks: those an earlier start wrote are taken off (see Reconciler). Pure, but for
the namespaces' labels it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuusage.api.models import GpuNodeUsageStatus
from gpuusage.api.policy import LabelSelector
from gpuusage.api.selectors import selects
from gpuusage_operator.index.pods import PodLookup


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
