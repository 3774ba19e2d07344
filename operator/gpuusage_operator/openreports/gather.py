"""What the OpenReports should say now, gathered from what the operator holds: the pods' marks
in the pod index (and, for pods it writes nothing on, the marks they would carry, in the report
book), the reports' judgements in the report book, the node rule of the policies.
Reads memory only; the writer does the I/O."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gpuusage.api.policy import NodeRule
from gpuusage_operator.controller.reportbook import ReportBook
from gpuusage_operator.index.pods import PodLookup
from gpuusage_operator.openreports.results import NodeFacts, namespace_results, node_results


@dataclass(frozen=True)
class Findings:
    """What `OpenReportsWriter.publish` takes."""

    namespaces: dict[str, list[dict[str, Any]]]
    nodes: list[dict[str, Any]]
    keep: frozenset[str]
    """Reports shown but not judged yet (after a start or a handover): their nodes' results
    stay as published, neither dropped nor made up."""


def gather(
    lookup: PodLookup,
    book: ReportBook,
    shown: Collection[str],
    node_rule: tuple[str, NodeRule] | None = None,
) -> Findings:
    """The findings of every pod carrying our marks, of every pod outside the operator's scope
    with the marks it would carry, and of every judged report; `shown`: the names of the
    reports the watch has shown (a report is named after its node)."""
    shown = set(shown)
    judged = {name: memory for name, memory in book.judged_whole().items() if name in shown}
    pods = {
        pod.uid: pod
        for node in sorted(lookup.nodes_with_our_marks())
        for pod in lookup.on_node_with_our_marks(node)
    }
    for _, memory in sorted(judged.items()):  # over marks it may not take off: those are old
        pods.update((pod.uid, pod) for pod in memory.unmarked)
    nodes = [
        result
        for name, memory in sorted(judged.items())
        for result in node_results(
            NodeFacts(name, memory.stale, memory.orphaned, memory.blind), node_rule
        )
    ]
    return Findings(namespace_results(pods.values()), nodes, frozenset(shown - set(judged)))
