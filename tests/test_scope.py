"""Where the operator writes on pods (controller.scope): --no-pod-marks and
--namespace-selector, decided without I/O, and the status that says which pods are outside."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from gpuusage.api.models import GpuNodeUsageStatus, PodUsage
from gpuusage.api.selectors import parse_selector
from gpuusage.kube.errors import Forbidden
from gpuusage_operator.controller.reconcile import Counts
from gpuusage_operator.controller.scope import Scope, mark_outside
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.podmarker import MarkMemory, PodMarker
from tests.builders import fixed

NOW = datetime(2026, 11, 28, 12, tzinfo=UTC)
LABELS = {"ml": {"team": "research"}, "web": {"team": "web"}}


def scope(text: str = "team=research", *, marks: bool = True) -> Scope:
    return Scope(marks, parse_selector(text), text, LABELS.get)


def test_a_namespace_not_listed_yet_is_left_as_it_is() -> None:
    assert scope().writes("ml") is True
    assert scope().writes("web") is False
    assert scope().writes("new") is None, "not known: nothing changed on a guess"
    assert Scope().writes("new") is True, "no selector: every namespace, known or not"
    assert scope(marks=False).writes("ml") is False
    assert Scope(marks=False).writes("new") is False
    assert str(scope()) == "--namespace-selector 'team=research'"
    assert str(Scope(marks=False)) == "pod marks off"


def usage(namespace: str) -> PodUsage:
    return PodUsage.model_validate(
        {
            "namespace": namespace,
            "name": "p",
            "uid": "0b6c3a52-9d0e-4b8e-8f1a-2c3d4e5f6a7b",
            "deviceUUID": "GPU-0b6c3a52-9d0e-4b8e-8f1a-2c3d4e5f6a7b",
        }
    )


def test_the_status_says_which_pods_are_outside_the_selector() -> None:
    status = GpuNodeUsageStatus(pods=[usage("ml"), usage("web"), usage("new")])
    marked = mark_outside(status, scope())
    assert [p.out_of_scope for p in marked.pods] == [False, True, False]
    assert marked.to_patch()["pods"][1]["outOfScope"] is True
    assert mark_outside(status, Scope(marks=False)) is status, "marks off: none is outside"


class RefusingPods:
    """A core API whose pod writes are refused for want of rights."""

    def __init__(self) -> None:
        self.calls = 0

    def patch_namespaced_pod(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise Forbidden("pods is forbidden: cannot patch resource", 403)

    patch_namespaced_pod_status = patch_namespaced_pod


def test_marks_an_install_may_not_take_off_are_tried_once_a_term() -> None:
    pods, memory = RefusingPods(), MarkMemory()
    marker = PodMarker(
        core=pods,
        counts=Counts(),
        events=cast(Any, None),
        memory=fixed(memory),
        write_budget=WriteBudget(),
    )
    marked = PodSnapshot("web", "p", "uid-1", "n1", annotations=(("gpuusage.io/gpus", "GPU-1"),))
    assert not marker.clear(marked)
    assert marker.refused
    assert not marker.clear(marked)
    assert pods.calls == 1, "not tried again in this term"
