"""A policy step met while the policies are being listed (again) is neither taken nor lost:
the subject is looked at again shortly, for its report may not change for a long time."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.policies.noderun import NodeMemory, NodeRunner
from gpuusage_operator.policies.run import PARTIAL_RETRY, PolicyRunner
from tests.builders import fixed

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def runner(synced: bool) -> tuple[PolicyRunner, list[Any]]:
    written: list[Any] = []
    watch = SimpleNamespace(synced=synced, covering=lambda *a: (None, False))
    policies = PolicyRunner(
        watch=cast(Any, watch),
        custom=None,
        annotate=lambda pod, patch: bool(written.append(patch) or True),  # type: ignore[func-returns-value]
        record=lambda *a: written.append(a),
    )
    return policies, written


def test_a_pod_met_while_the_policies_are_listed_is_looked_at_again_shortly() -> None:
    policies, written = runner(synced=False)
    pod = PodSnapshot("ml", "train", "u-1", "n1")
    assert policies.visit(pod, cast(Any, None), NOW) == NOW + PARTIAL_RETRY
    assert written == [], "nothing taken on a partial view"
    listed, _ = runner(synced=True)
    assert listed.visit(pod, cast(Any, None), NOW) is None, "no policy covers it: no step"


def test_a_node_met_while_the_policies_are_listed_is_looked_at_again_shortly() -> None:
    policies, written = runner(synced=False)
    nodes = NodeRunner(policies, lambda *a: written.append(a), fixed(NodeMemory()))
    assert nodes.visit("n1", None, certain=True, now=NOW) == NOW + PARTIAL_RETRY
    assert written == []
