"""Where the operator writes on pods (controller.scope): --no-pod-marks and
--namespace-selector, decided without I/O, and the status that says which pods are outside."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from gpuusage.api.models import GpuNodeUsageStatus, PodUsage
from gpuusage.api.policy import GpuUsagePolicySpec
from gpuusage.api.selectors import parse_selector
from gpuusage.api.times import format_time
from gpuusage.kube.errors import Forbidden
from gpuusage_operator.controller.reconcile import Counts
from gpuusage_operator.controller.scope import (
    Scope,
    as_carried,
    judged_lookup,
    mark_outside,
    unheeded,
)
from gpuusage_operator.index.keptpods import KeptPods
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.idle import idle_since
from gpuusage_operator.judge.podstate import Verdict
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.marks import would_carry
from gpuusage_operator.writers.podmarker import MarkMemory, PodMarker
from tests.builders import fixed

NOW = datetime(2026, 11, 28, 12, tzinfo=UTC)
LABELS = {"ml": {"team": "research"}, "web": {"team": "web"}}
NAMES = ("carried", "idle", "used", "never")


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


def marker_on(pods: RefusingPods) -> PodMarker:
    """A pod marker writing through `pods`, with a memory of its own."""
    return PodMarker(
        core=pods,
        counts=Counts(),
        events=cast(Any, None),
        memory=fixed(MarkMemory()),
        write_budget=WriteBudget(),
    )


def test_marks_an_install_may_not_take_off_are_tried_once_a_term() -> None:
    pods = RefusingPods()
    marker = marker_on(pods)
    marked = PodSnapshot("web", "p", "uid-1", "n1", annotations=(("gpuusage.io/gpus", "GPU-1"),))
    assert not marker.clear(marked)
    assert marker.refused
    assert not marker.clear(marked)
    assert pods.calls == 1, "not tried again in this term"


HOUR_AGO = NOW - timedelta(hours=1)


def exempt_pods(
    namespace: str, tag: str, condition: tuple[tuple[str, str], ...] = ()
) -> dict[str, PodSnapshot]:
    """A running pod asking for a GPU under each of NAMES on node n1, which a person marked
    exempt (an annotation that is not the operator's), with `condition` as its GPUInUse."""
    return {
        name: PodSnapshot(
            namespace,
            name,
            f"{n:08x}-{tag}-4b8e-8f1a-2c3d4e5f6a7b",
            "n1",
            annotations=(("gpuusage.io/exempt", "true"),),
            condition=condition,
            running=True,
            started_at="2026-11-27T00:00:00Z",
            gpu_requests=1,
        )
        for n, name in enumerate(NAMES)
    }


def remembered(
    pods: dict[str, PodSnapshot], namespace: str
) -> tuple[KeptPods, PodSnapshot, GpuNodeUsageStatus]:
    """The index of these pods, the marks "carried" would carry (its condition False an hour
    ago), and the report's last status: "idle" listed idle an hour ago, "used" in use."""
    kept = KeptPods()
    for ref in pods.values():
        kept.put(ref)
    carried = replace(
        pods["carried"],
        annotations=(("gpuusage.io/gpus", "GPU-1"),),
        condition=(("lastTransitionTime", format_time(HOUR_AGO)), ("status", "False")),
    )
    idle = {"namespace": namespace, "name": "idle", "uid": pods["idle"].uid, "idleSince": HOUR_AGO}
    used = usage(namespace).model_dump(by_alias=True) | {"name": "used", "uid": pods["used"].uid}
    status = GpuNodeUsageStatus.model_validate({"idlePods": [idle], "pods": [used]})
    return kept, carried, status


def test_the_judge_sees_a_pod_outside_with_the_marks_it_would_carry() -> None:
    """Where the operator writes nothing on a pod, the judge takes for its memory the marks the
    pod would carry, else the report's last status, never what the pod shows (an earlier
    install's marks it may not take off) nor nothing for a pod it saw in use: such a pod whose
    processes ended is not idle since it started."""
    hour_ago = HOUR_AGO
    old_marks = (("lastTransitionTime", "2026-11-27T01:00:00Z"), ("status", "True"))
    pods = exempt_pods("web", "9d0e", condition=old_marks)
    uids = {name: ref.uid for name, ref in pods.items()}
    kept, carried, status = remembered(pods, "web")
    lookup = judged_lookup(PodLookup(kept), Scope(marks=False), {carried.uid: carried}, status, NOW)
    seen = {name: lookup.by_uid(uids[name]) for name in NAMES}
    since = {name: idle_since(ref, NOW) for name, ref in seen.items() if ref is not None}
    assert since == {
        "carried": hour_ago,  # its would-be condition turned False an hour ago
        "idle": hour_ago,  # the status said so
        "used": NOW,  # in use at the last status: idle from now, not from its start
        "never": datetime(2026, 11, 27, tzinfo=UTC),  # never seen in use: since it started
    }
    carried_seen = seen["carried"]
    assert carried_seen is not None
    assert carried_seen.our_annotations == {
        "gpuusage.io/exempt": "true",  # a person's, kept
        "gpuusage.io/gpus": "GPU-1",
    }
    assert [r.name for r in lookup.on_node_with_our_marks("n1")] == ["carried", "idle", "used"]
    as_is = judged_lookup(PodLookup(kept), Scope(), {}, status, NOW)
    assert as_is.by_uid(uids["never"]) == pods["never"], "every pod written on: as it is"


def test_a_pod_inside_that_carries_no_marks_yet_is_seen_with_what_was_remembered() -> None:
    """Marks turned on (a restart without --no-pod-marks), or a namespace that comes into
    --namespace-selector: a pod the operator wrote nothing on so far carries none of its marks.
    The judge takes the same memory as for a pod outside (the marks it would have carried,
    else the report's last status), not its start: a pod seen in use whose processes then
    ended is not idle since it started. A pod inside that carries marks is seen as it is; its
    marks are written against what it carries, not against the memory."""
    hour_ago = HOUR_AGO
    pods = exempt_pods("ml", "1d0e")
    own = (("lastTransitionTime", "2026-11-28T11:50:00Z"), ("status", "False"))
    pods["own"] = replace(pods["never"], name="own", uid="ffffffff-1d0e", condition=own)
    kept, carried, status = remembered(pods, "ml")
    for inside in (Scope(), scope("team=research")):  # marks turned on; namespace selected
        lookup = judged_lookup(PodLookup(kept), inside, {carried.uid: carried}, status, NOW)
        seen = {name: lookup.by_uid(ref.uid) for name, ref in pods.items()}
        since = {name: idle_since(ref, NOW) for name, ref in seen.items() if ref is not None}
        assert since == {
            "carried": hour_ago,  # outside at the last reconcile: the marks it would carry
            "idle": hour_ago,  # the status said so
            "used": NOW,  # in use at the last status: idle from now, not from its start
            "never": datetime(2026, 11, 27, tzinfo=UTC),  # never seen in use: since it started
            "own": datetime(2026, 11, 28, 11, 50, tzinfo=UTC),  # its own marks
        }, inside
        assert seen["own"] == pods["own"], "a pod that carries marks: as it is"
        assert [r.name for r in lookup.on_node_with_our_marks("n1")] == [
            "own",
            "carried",
            "used",
            "idle",
        ], "remembered with marks: its use may have ended meanwhile"
        judged = seen["used"]
        assert judged is not None
        assert judged.marked
        assert as_carried(judged, pods["used"]) == pods["used"], "written against none"
        assert as_carried(pods["own"], pods["own"]) == pods["own"]


def test_a_pod_that_carries_no_marks_is_remembered_while_they_settle() -> None:
    """A pod remembered in use whose processes are gone settles before its use counts as
    ended: nothing is written meanwhile, so the memory the judge saw is carried to the next
    reconcile, or the pod would be idle since its start once the status stops listing it."""
    remembered = PodSnapshot(
        "ml", "used", "uid-1", "n1", condition=(("status", "True"),), running=True
    )
    settling = Verdict(remembered, "Stopped", settles_until=NOW + timedelta(seconds=5))
    assert would_carry(settling, None, NOW) == remembered
    before = replace(remembered, condition=(("status", "False"),))
    assert would_carry(settling, before, NOW) == before, "what it would carry already"
    bare = Verdict(replace(remembered, condition=()), "Stopped", settles_until=NOW)
    assert would_carry(bare, None, NOW) is None, "nothing remembered: nothing carried"


def test_a_policy_the_scope_keeps_from_acting_is_said_of() -> None:
    """An Enforce policy that never acts is explained: with pod marks off no policy acts on a
    pod (node rules still run); outside --namespace-selector, on no pod there."""
    idle = {"finding": "RequestedGPUsIdle", "after": "2h", "action": "Notify"}
    node = {"finding": "OrphanedGPUMemory", "action": "Notify"}
    policies = {
        "everywhere": GpuUsagePolicySpec.model_validate({"rules": [idle]}),
        "research": GpuUsagePolicySpec.model_validate(
            {"namespaceSelector": {"matchLabels": {"team": "research"}}, "rules": [idle]}
        ),
        "nodes": GpuUsagePolicySpec.model_validate({"nodeRules": [node]}),
    }
    said = unheeded(policies, LABELS, scope(marks=False))
    assert sorted(said) == ["everywhere", "research"], "node rules act all the same"
    assert "pod marks are off (--no-pod-marks)" in said["research"]
    said = unheeded(policies, LABELS, scope())
    assert list(said) == ["everywhere"], "research's namespaces are all inside"
    assert said["everywhere"] == (
        "policy everywhere covers namespaces outside the operator's scope "
        "(--namespace-selector 'team=research'): web; it announces nothing and acts on no pod "
        "there"
    )
    many = {f"ns-{n}": {"team": "web"} for n in range(7)}
    wide = Scope(True, parse_selector("team=research"), "team=research", many.get)
    assert "ns-4 and 2 more;" in unheeded(policies, many, wide)["everywhere"]
    assert unheeded(policies, LABELS, Scope()) == {}, "every pod in scope"


class WebhookRefusing(RefusingPods):
    """A core API whose writes of one pod an admission webhook refuses."""

    def patch_namespaced_pod(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise Forbidden('admission webhook "validate.kyverno.svc" denied the request', 403)

    patch_namespaced_pod_status = patch_namespaced_pod


def test_a_webhook_refusing_one_pod_stops_no_other() -> None:
    pods = WebhookRefusing()
    marker = marker_on(pods)
    first = PodSnapshot("web", "a", "uid-1", "n1", annotations=(("gpuusage.io/gpus", "G"),))
    other = replace(first, name="b", uid="uid-2")
    assert not marker.clear(first)
    assert not marker.refused, "a webhook's refusal is no want of rights"
    assert not marker.clear(other)
    assert pods.calls == 2, "the other pod is tried"
