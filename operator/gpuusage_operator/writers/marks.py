"""A pod's marks written: the smallest patch from what the pod shows to what the judge wants
(see judge.podstate.WantedMarks), and the Event a change of its condition records. Pure.

The judge decides what each pod should carry; this diffs that against the pod and says what to
write. Patches are None when nothing would change: an unchanged report costs no pod write and
no Event. A pod's detail (its memory, pids and shares, and when they were observed) is shown
only when it moved by a step a person cares about, at most once every DETAIL_EVERY (see
held_detail): the devices, the finding and the condition at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from gpuusage.api import names
from gpuusage.api.reasons import EventReason, PodFinding
from gpuusage.api.summary import share_moved
from gpuusage.api.times import format_time, parse_time
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.findings import (
    REASON_HELD_IDLE,
    REASON_IDLE,
    REASON_UNALLOCATED,
    REASON_UNREQUESTED,
)
from gpuusage_operator.judge.podstate import Verdict, WantedMarks
from gpuusage_operator.judge.transitions import transition_time

OUR_ANNOTATIONS = (names.ANNOTATION_GPUS, names.ANNOTATION_GPU_MEMORY_MIB, names.ANNOTATION_USAGE)

WARNED_USE: dict[PodFinding, str] = {
    REASON_UNREQUESTED: "GPUs it did not request",
    REASON_UNALLOCATED: "a GPU outside its allocation",
    REASON_HELD_IDLE: "GPU memory without computing",
}
"""In-use reasons that are findings: each gets a Warning Event when it starts."""


def _warned(reason: str | None) -> PodFinding | None:
    """The in-use finding a condition's reason states, if it is one."""
    return next((finding for finding in WARNED_USE if finding == reason), None)


SHARE_MOVED = 0.1
"""A container's share of a device moving by less than this is no move of its detail."""
MEMORY_STEP = 0.10
"""The pod's memory moving by less than this part of what its annotation shows (and less than
MEMORY_STEP_MIB) is no move of its detail: a caching allocator's growth and an inference
server's breathing are not news to a person reading the pod (the status has every MiB)."""
MEMORY_STEP_MIB = 256
DETAIL_EVERY = timedelta(minutes=10)
"""The least time between two writes of a pod's detail alone (its memory, pids, shares): a move
within it waits, and is shown then, as it is by then."""


def _usage(annotations: Mapping[str, str]) -> dict[str, Any] | None:
    try:
        doc = json.loads(annotations.get(names.ANNOTATION_USAGE, ""))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _layout(doc: Mapping[str, Any]) -> list[Any]:
    """Which containers use which devices: what a person reads in the detail, beside numbers."""
    return [
        (c.get("name"), [d.get("uuid") for d in c.get("devices") or [] if isinstance(d, dict)])
        for c in doc.get("containers") or []
        if isinstance(c, dict)
    ] + [doc.get("truncated", False)]


def _pids(doc: Mapping[str, Any]) -> list[Any]:
    """Each device slot's pids: a process replaced in a container is news (at most once every
    DETAIL_EVERY, as the rest of the detail), or a tenant's `ps -n` would show it for good."""
    return [
        sorted(d.get("pids") or [])
        for c in doc.get("containers") or []
        if isinstance(c, dict)
        for d in c.get("devices") or []
        if isinstance(d, dict)
    ]


def _shares(doc: Mapping[str, Any]) -> list[float | None]:
    return [
        d.get("share")
        for c in doc.get("containers") or []
        if isinstance(c, dict)
        for d in c.get("devices") or []
        if isinstance(d, dict)
    ]


def _as_written(current: Mapping[str, str], doc: Mapping[str, Any]) -> bool:
    """Whether the memory annotation is the usage detail's sum, as the operator writes them
    (a hand edit of one is put right at once, not held back as detail)."""
    if doc.get("truncated"):
        return True  # (containers left out: the sum cannot be checked)
    total = sum(
        d.get("mib", 0)
        for c in doc.get("containers") or []
        if isinstance(c, dict)
        for d in c.get("devices") or []
        if isinstance(d, dict)
    )
    return current.get(names.ANNOTATION_GPU_MEMORY_MIB) == str(total)


def _memory_moved(current: Mapping[str, str], desired: Mapping[str, str]) -> bool:
    try:
        old = int(current[names.ANNOTATION_GPU_MEMORY_MIB])
        new = int(desired[names.ANNOTATION_GPU_MEMORY_MIB])
    except (KeyError, ValueError):
        return True
    return abs(new - old) >= max(MEMORY_STEP_MIB, MEMORY_STEP * old)


def held_detail(
    current: Mapping[str, str], desired: Mapping[str, str] | None, now: datetime
) -> tuple[dict[str, str] | None, datetime | None]:
    """The annotations to show: `desired`, or with its detail (memory, pids, shares, the time
    it was observed) as `current` shows it where the use is the same otherwise (same devices,
    same containers on them); and when detail held back is to be shown.

    The devices, the finding and the condition are written at once; the detail only when it
    moved by a step a person cares about (MEMORY_STEP, SHARE_MOVED, another pid) and
    DETAIL_EVERY after the detail shown was observed, so that a steady pod, whose memory and
    shares always move a little, costs no write (every heartbeat of its node carries a new
    observation time), and a growing one at most one per DETAIL_EVERY. The time is the one the
    annotation shows (the agent's); one in the future (a clock ahead) holds nothing back."""
    if not desired or not current:
        return (dict(desired) if desired is not None else None), None
    old, new = _usage(current), _usage(desired)
    if (
        old is None
        or new is None
        or current.get(names.ANNOTATION_GPUS) != desired.get(names.ANNOTATION_GPUS)
        or _layout(old) != _layout(new)
        or not _as_written(current, old)
    ):
        return dict(desired), None
    kept = {**desired}
    for key in (names.ANNOTATION_GPU_MEMORY_MIB, names.ANNOTATION_USAGE):
        if key in current:
            kept[key] = current[key]
    shares = zip(_shares(old), _shares(new), strict=True)
    moved = (
        _memory_moved(current, desired)
        or _pids(old) != _pids(new)
        or any(share_moved(a, b, SHARE_MOVED) for a, b in shares)
    )
    if not moved:
        return kept, None
    since = parse_time(old.get("observedAt"))
    if since is not None and since <= now < since + DETAIL_EVERY:
        return kept, since + DETAIL_EVERY
    return dict(desired), None


def annotation_patch(
    current: Mapping[str, str], desired: Mapping[str, str] | None
) -> dict[str, str | None] | None:
    """The metadata.annotations merge patch from current to desired (None: remove ours).

    Returns None when nothing would change.
    """
    patch: dict[str, str | None] = {}
    for key in OUR_ANNOTATIONS:
        want = None if desired is None else desired.get(key)
        if current.get(key) != want:
            patch[key] = want
    return patch or None


def condition_patch(
    current: Iterable[Mapping[str, Any]], desired: Mapping[str, str], now: datetime
) -> dict[str, Any] | None:
    """The condition to send through a strategic-merge patch of pods/status, or None.

    lastTransitionTime follows transitions.transition_time.
    """
    existing = next((c for c in current if c.get("type") == desired["type"]), None)
    if existing is not None and all(existing.get(k) == v for k, v in desired.items()):
        return None
    transition = transition_time(
        None if existing is None else existing.get("status"),
        None if existing is None else existing.get("lastTransitionTime"),
        desired["status"],
        format_time(now),
    )
    return {**desired, "lastTransitionTime": transition}


@dataclass(frozen=True)
class PodEvent:
    reason: EventReason
    note: str
    type: Literal["Normal", "Warning"] = "Normal"


def event_for(
    previous: Mapping[str, Any] | None, new: Mapping[str, str], resumed: str | None = None
) -> PodEvent | None:
    """The Event to record on a condition change, or None: only transitions, never per cycle.

    Use starting and ending are Normal; starting on a GPU the pod never requested, and
    requested GPUs turning idle, are Warnings (what a person looking at the pod should act on).
    Use seen again after a spell of Unknown went on rather than started: no Event, and no
    second Warning for a finding that is what the pod showed before the spell (`resumed`:
    that reason, where known).
    """
    before = (previous or {}).get("status")
    before_reason = (previous or {}).get("reason")
    finding = _warned(new["reason"])
    if before == "Unknown" and resumed is not None and new["reason"] == resumed:
        return None  # known again as it was before the spell: nothing happened to the pod
    if new["status"] == "True" and before == "Unknown" and finding is None:
        return None  # use seen again after a spell of not knowing: it went on, it did not start
    if new["status"] == "True" and before != "True":
        if finding is not None:
            return PodEvent(finding, f"started using {WARNED_USE[finding]}", "Warning")
        return PodEvent("GPUUseStarted", "started using GPUs")
    if finding is not None and before_reason != new["reason"]:
        return PodEvent(finding, f"uses {WARNED_USE[finding]}", "Warning")
    if new["reason"] == REASON_IDLE and before_reason != REASON_IDLE:
        return PodEvent(REASON_IDLE, "requested GPUs are idle", "Warning")
    if new["status"] == "False" and before in ("True", "Unknown"):
        return PodEvent("GPUUseEnded", "stopped using GPUs")
    return None


@dataclass(frozen=True)
class PodPlan:
    """The writes that bring a pod to its verdict; None where nothing would change."""

    annotations: dict[str, str]
    """Our annotations once the plan is applied (empty: none)."""
    annotation_patch: dict[str, str | None] | None
    condition: dict[str, str]
    """The condition once the plan is applied (with its lastTransitionTime)."""
    condition_patch: dict[str, Any] | None
    event: PodEvent | None
    """Recorded once the condition patch landed."""
    event_note: str = ""
    due: datetime | None = None
    """When detail held back (see held_detail) is to be shown: the pod's report is judged
    again then."""


def plan_pod(
    marks: WantedMarks,
    shown_annotations: Mapping[str, str],
    shown_condition: Mapping[str, Any] | None,
    now: datetime,
    *,
    remembered: Mapping[str, Any] | None = None,
    known: Mapping[str, str] | None = None,
    resumed: str | None = None,
) -> PodPlan:
    """From what the pod shows now to the marks its verdict wants (see podstate.WantedMarks). An
    Unknown pod keeps the last known use in its annotations; a condition whose state began
    before now (an idle pod's: the start of its idleness) dates from then.
    `remembered`: the condition the operator last wrote, where someone removed it since: the
    transition is judged from it (no Event for a condition put back as it was) and its
    transition time kept when its status stands. `known`: the annotations the operator last
    wrote on the pod, where it remembers them: an Unknown pod keeps those, not what someone may
    have written over them since. `resumed`: the reason the pod showed before its condition
    turned Unknown, where the operator remembers it (see event_for)."""
    due = None
    if marks.annotations is None:  # last known use kept
        wanted = dict(shown_annotations if known is None else known)
    else:
        held, due = held_detail(shown_annotations, marks.annotations, now)
        wanted = held or {}
    condition = marks.condition
    patch = annotation_patch(shown_annotations, wanted or None)
    since = marks.since or now
    cpatch = condition_patch([shown_condition] if shown_condition else [], condition, since)
    previous = shown_condition if remembered is None else remembered
    if cpatch is not None and remembered is not None:
        kept = condition_patch([remembered], condition, since)
        when = (kept or remembered).get("lastTransitionTime") or format_time(since)
        cpatch = {**condition, "lastTransitionTime": when}
    event = event_for(previous, condition, resumed) if cpatch is not None else None
    return PodPlan(
        annotations=wanted,
        annotation_patch=patch,
        condition={**condition, **cpatch} if cpatch else dict(shown_condition or condition),
        condition_patch=cpatch,
        event=event,
        event_note="" if event is None else f"{event.note}: {condition['message']}",
        due=due,
    )


def shows(
    annotations: Mapping[str, str], condition: Mapping[str, str] | None, plan: PodPlan
) -> bool:
    """Whether a pod carrying these marks carries what the plan brings it to: nothing of the
    plan left to write (a usage annotation within its rounding counts as the same)."""
    if annotation_patch(annotations, plan.annotations or None) is not None:
        return False
    return condition is not None and all(condition.get(k) == v for k, v in plan.condition.items())


def would_carry(verdict: Verdict, before: PodSnapshot | None, now: datetime) -> PodSnapshot | None:
    """The pod as it would be with the marks its verdict wants, for a pod that carries none of
    them (outside the operator's scope, or inside with none written yet): `before`, what it
    would have carried after the last reconcile, keeps a condition's transition time. While
    its marks settle, as it was: `before`, else as the judge saw it (with what it remembered of
    it, see controller.scope.JudgedMarks), else None."""
    if verdict.settles_until is not None or verdict.marks is None:
        return before if before is not None or not verdict.pod.marked else verdict.pod
    shown = before if before is not None else replace(verdict.pod, annotations=(), condition=())
    plan = plan_pod(verdict.marks, shown.our_annotations, shown.our_condition, now)
    return replace(
        verdict.pod,
        annotations=tuple(sorted(plan.annotations.items())),
        condition=tuple(sorted(plan.condition.items())),
    )
