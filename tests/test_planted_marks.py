"""A tenant who writes the operator's annotations on their own pod fools nothing.

Where a pod was last seen using GPUs decides whether its use can be called ended (a device the
node no longer reports could hide its processes: Unknown) and whether it can be judged idle. The
pod's `gpuusage.io/gpus` annotation is the pod's word; anyone who may edit the pod can write it.
Planted over what the operator wrote, or on a pod never seen in use, naming a device the node
does not have, it kept the pod Unknown for good and out of idle judgement (so out of reach of
an idle policy). The operator judges from what it wrote itself, and puts its annotations right.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage_operator.controller.reconcile import Reconciler, remember
from gpuusage_operator.controller.term import new_terms
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.certainty import last_seen
from gpuusage_operator.judge.podstate import Verdict, mark_of
from gpuusage_operator.writers.marks import plan_pod
from tests.conftest import WorldFactory, wait_for
from tests.simworld import SimWorld
from tests.worldview import condition, conditions, pod, pod_annotations, report

PLANTED = {names.ANNOTATION_GPUS: "GPU-planted"}
NOW = datetime(2026, 11, 27, tzinfo=UTC)


def plant(world: SimWorld, name: str) -> None:
    core: client.CoreV1Api = world.core
    core.patch_namespaced_pod(name, world.ns, {"metadata": {"annotations": PLANTED}})


def reason(world: SimWorld, name: str) -> str | None:
    found = [c for c in conditions(pod(world, name)) if c.type == names.POD_CONDITION_GPU_IN_USE]
    return f"{found[0].status} {found[0].reason}" if found else None


@pytest.mark.cluster
def test_a_device_planted_on_a_pod_never_seen_in_use_does_not_keep_it_from_idle(
    make_world: WorldFactory,
) -> None:
    world = make_world({"train": 1, "notebook": 1, "waiter": 2}, idle_after=4.0)
    plant(world, "waiter")
    wait_for(
        lambda: reason(world, "waiter") == "False RequestedGPUsIdle",
        timeout=30,
        what="the waiter judged idle although its annotation names a device the node lacks",
    )
    wait_for(
        lambda: names.ANNOTATION_GPUS not in pod_annotations(world, "waiter"),
        what="the planted annotation removed",
    )


@pytest.mark.cluster
def test_a_device_planted_while_use_ends_does_not_make_it_unknown(
    make_world: WorldFactory,
) -> None:
    world = make_world({"train": 1, "notebook": 1})
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="in use")
    world.write(notebook=False)

    def notebook_listed() -> bool:
        listed = (report(world).get("status") or {}).get("pods") or []
        return any(p["name"] == "notebook" for p in listed)

    # Planted once the report no longer shows the notebook's process: its marks settle (stay
    # as they are for a few seconds) before its use is called ended, judged from where it was.
    wait_for(lambda: not notebook_listed(), what="the notebook's process gone from the report")
    plant(world, "notebook")
    wait_for(
        lambda: reason(world, "notebook") == "False ProcessesEnded",
        what="the use ended, judged from the device the operator saw it on",
    )
    assert names.ANNOTATION_GPUS not in pod_annotations(world, "notebook")
    assert world.reconciler.counts.pod_errors == 0


@dataclass
class _Counts:
    pod_writes: int = 0
    uid_refusals: int = 0
    writes_deferred: int = 0
    api_errors: Counter[str] = field(default_factory=Counter)


def _pod(annotations: dict[str, str], status: str | None) -> PodSnapshot:
    condition = (
        ()
        if status is None
        else (("reason", "X"), ("status", status), ("type", names.POD_CONDITION_GPU_IN_USE))
    )
    return PodSnapshot(
        "ns",
        "p",
        "uid-1",
        "n1",
        annotations=tuple(sorted(annotations.items())),
        condition=condition,
    )


def test_where_a_pod_was_last_seen_is_what_the_operator_judged_else_a_vouched_annotation() -> None:
    planted = _pod(PLANTED, "True")
    assert last_seen(planted, {}) == ["GPU-planted"], "after a restart: the pod's word"
    assert last_seen(_pod(PLANTED, None), {}) is None, "no condition of ours: none"
    assert last_seen(_pod(PLANTED, "False"), {}) is None
    assert last_seen(planted, {"uid-1": ("GPU-real",)}) == ["GPU-real"], "judged, not planted"
    assert last_seen(planted, {"uid-1": ()}) is None, "its use ended: seen nowhere"


def test_the_reconciler_keeps_what_the_judge_saw_for_its_term_only() -> None:
    """In use: the devices; ended or idle: nowhere; Unknown or settling: as it was. A new term
    starts with none of it (another replica may have judged meanwhile)."""
    terms = new_terms()
    reconciler = Reconciler(cast(Any, None), cast(Any, None), cast(Any, None), WorkQueue(), terms)
    term = terms.current
    pod = _pod(PLANTED, "True")
    use = cast(Any, SimpleNamespace(devices=["GPU-real"]))
    remember(term, Verdict(pod, "InUse", use))
    assert term.seen_on == {"uid-1": ("GPU-real",)}
    remember(term, Verdict(pod, "Unknown"))
    remember(term, Verdict(pod, "Stopped", settles_until=NOW, absent_since=NOW))
    assert term.seen_on == {"uid-1": ("GPU-real",)}
    assert term.absent == {"uid-1": NOW}
    remember(term, Verdict(pod, "Stopped"))
    assert (term.seen_on, term.absent) == ({"uid-1": ()}, {})
    remember(term, Verdict(pod, "Stopped", settles_until=NOW, absent_since=NOW))
    reconciler.liveness.judge("n1", 1, NOW, None, NOW)
    assert reconciler.liveness.deadline("n1", NOW) is not None
    terms.begin()
    assert (terms.current.seen_on, terms.current.absent) == ({}, {})
    assert reconciler.liveness.deadline("n1", NOW) is None, "seen afresh, as at start"


def test_an_unknown_pod_keeps_what_the_operator_wrote() -> None:
    shown = {**PLANTED, names.ANNOTATION_GPU_MEMORY_MIB: "1"}
    known = {names.ANNOTATION_GPUS: "GPU-real", names.ANNOTATION_GPU_MEMORY_MIB: "4096"}
    verdict = Verdict(_pod(shown, "True"), "Unknown")
    now = datetime(2026, 11, 25, tzinfo=UTC)
    marks = mark_of(verdict, "n1")
    kept = plan_pod(marks, shown, None, now, known=known)
    assert kept.annotation_patch == known
    assert plan_pod(marks, shown, None, now).annotation_patch is None, "unremembered"
