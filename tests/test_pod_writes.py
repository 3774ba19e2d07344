"""A policy's announcement is a pod write like the marks: its echo is known as the operator's
own (no reconcile for it) where the pod showed what this replica applied, and not where
someone else edited the pod's marks meanwhile. The pods API is answered in-process, as the
apiserver would (the patched pod with a new resourceVersion)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpuusage.api import names
from gpuusage_operator.controller.reconcile import Counts
from gpuusage_operator.index.pods import snapshot_of
from gpuusage_operator.judge.podstate import Verdict, mark_of
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.podmarker import MarkMemory, PodMarker
from tests.builders import fixed

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
ANNOUNCED: dict[str, str | None] = {names.ANNOTATION_POLICY_ACTION: '{"policy":"p"}'}


class _Events:
    def record(self, *args: Any) -> None:
        """No Event is looked at here."""


class _Pods:
    """One pod, patched as the apiserver patches it."""

    def __init__(self) -> None:
        self.pod: dict[str, Any] = {
            "metadata": {"name": "nb", "namespace": "ml", "uid": "uid-1", "resourceVersion": "1"},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Running"},
        }

    def _answer(self) -> Any:
        meta = self.pod["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return SimpleNamespace(data=json.dumps(self.pod).encode(), release_conn=lambda: None)

    def patch_namespaced_pod(self, name: str, ns: str, body: dict[str, Any], **_: Any) -> Any:
        shown = self.pod["metadata"].setdefault("annotations", {})
        for key, value in body["metadata"]["annotations"].items():
            if value is None:
                shown.pop(key, None)
            else:
                shown[key] = value
        return self._answer()

    def patch_namespaced_pod_status(
        self, name: str, ns: str, body: dict[str, Any], **_: Any
    ) -> Any:
        wanted = body["status"]["conditions"]
        kept = [
            c
            for c in self.pod["status"].get("conditions", [])
            if c["type"] not in {w["type"] for w in wanted}
        ]
        self.pod["status"]["conditions"] = kept + wanted
        return self._answer()


def judged_as(verdict: Verdict) -> Verdict:
    """The verdict with its marks, as the judge hands it over (see podstate.verdicts)."""
    return replace(verdict, marks=mark_of(verdict, "n1"))


def test_a_verdict_without_marks_is_refused() -> None:
    pods = _Pods()
    marker = PodMarker(
        core=pods,
        memory=fixed(MarkMemory()),
        counts=Counts(),
        events=cast(Any, None),
        write_budget=WriteBudget(),
    )
    before = snapshot_of(pods.pod)
    assert before is not None
    with pytest.raises(ValueError, match="no marks"):
        marker.mark(Verdict(before, "Unknown"), "n1", NOW)


def _marked() -> tuple[PodMarker, _Pods]:
    """A pod this replica has marked (its condition written: Unknown, the report stale)."""
    pods = _Pods()
    events: Any = _Events()
    marker = PodMarker(
        core=pods,
        memory=fixed(MarkMemory()),
        counts=Counts(),
        events=events,
        write_budget=WriteBudget(),
    )
    before = snapshot_of(pods.pod)
    assert before is not None
    assert marker.mark(judged_as(Verdict(before, "Unknown")), "n1", NOW) is not None
    return marker, pods


def test_an_announcements_echo_is_known_as_the_operators_own() -> None:
    marker, pods = _marked()
    shown = snapshot_of(pods.pod)  # the index shows the echo of the marks
    assert shown is not None
    assert marker.wrote(shown.uid, shown.resource_version)
    assert marker.annotate(shown, ANNOUNCED)
    echo = pods.pod["metadata"]["resourceVersion"]
    assert marker.wrote(shown.uid, echo)


def test_an_announcement_over_someone_elses_edit_is_not_taken_for_an_echo() -> None:
    marker, pods = _marked()
    shown = snapshot_of(pods.pod)
    assert shown is not None
    pods.pod["status"]["conditions"] = []  # a person removes our condition meanwhile
    assert marker.annotate(shown, ANNOUNCED)
    echo = pods.pod["metadata"]["resourceVersion"]
    assert not marker.wrote(shown.uid, echo)
    assert not marker.wrote(shown.uid, shown.resource_version)  # the index decides now


def test_an_announcement_takes_its_write_from_the_budget() -> None:
    pods = _Pods()
    due: list[set[str]] = []
    events: Any = _Events()
    marker = PodMarker(
        core=pods,
        memory=fixed(MarkMemory()),
        counts=Counts(),
        events=events,
        write_budget=WriteBudget(0.001, 2),
        monotonic=lambda: 0.0,
        due=due.append,
    )
    shown = snapshot_of(pods.pod)
    assert shown is not None
    assert marker.admit_pod(shown)
    assert marker.admit_pod(shown)
    assert not marker.admit_pod(shown)
    assert marker.counts.writes_deferred == 1
    assert due == [{"n1"}]


class _Recorded:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def record(self, namespace: str, regarding: Any, what: Any, note: str, now: Any) -> None:
        self.reasons.append(what.reason)


def test_a_finding_seen_again_after_a_spell_of_unknown_is_not_flagged_again() -> None:
    """Unrequested use, then the node's report stale (Unknown), then the same use again: one
    Warning. Another finding after the spell is one: it was not what the pod showed."""
    from gpuusage.api.models import Process  # noqa: PLC0415
    from gpuusage_operator.judge.allocation import Allocation, Judgement  # noqa: PLC0415
    from gpuusage_operator.judge.resolution import PodUse, Resolution  # noqa: PLC0415

    pods, events = _Pods(), _Recorded()
    recorder: Any = events
    marker = PodMarker(
        core=pods,
        memory=fixed(MarkMemory()),
        counts=Counts(),
        events=recorder,
        write_budget=WriteBudget(),
    )

    def judged(finding: Any) -> None:
        pod = snapshot_of(pods.pod)
        assert pod is not None
        use = PodUse(pod, "n1", NOW, (Resolution("GPU-0", Process(pid=7), pod),))
        verdict = Verdict(pod, "InUse", use, judgement=Judgement(Allocation(), finding))
        marker.mark(judged_as(verdict), "n1", NOW)

    def unknown() -> None:
        pod = snapshot_of(pods.pod)
        assert pod is not None
        marker.mark(judged_as(Verdict(pod, "Unknown")), "n1", NOW)

    judged("Unrequested")
    unknown()
    judged("Unrequested")
    assert events.reasons == ["UsingUnrequestedGPU"]
    unknown()
    judged("Unallocated")  # not what it showed before the spell
    assert events.reasons == ["UsingUnrequestedGPU", "UsingUnallocatedGPU"]


def test_known_again_as_before_the_spell_records_no_event() -> None:
    from gpuusage_operator.writers.marks import event_for  # noqa: PLC0415

    unknown = {"status": "Unknown", "reason": "NodeReportStale"}
    idle = {"status": "False", "reason": "RequestedGPUsIdle"}
    ended = {"status": "False", "reason": "ProcessesEnded"}
    assert event_for(unknown, idle, resumed="RequestedGPUsIdle") is None
    warned = event_for(unknown, idle)
    assert warned is not None
    assert warned.type == "Warning"  # not remembered: said again
    assert event_for(unknown, ended, resumed="ProcessesEnded") is None
    moved = event_for(unknown, ended, resumed="ProcessesRunning")
    assert moved is not None
    assert moved.reason == "GPUUseEnded"
