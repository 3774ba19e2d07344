"""Node rules carried out: the thin edge between policies.noderule's steps and the Node.

Each reconcile, after the pods, asks about its node (visit) with the orphaned memory its status
now states and whether the report is certain (fresh, every device seen). The marks the node
carries are read once and then remembered (read again every REREAD, so that a hand edit is
repaired); a dry run, a refusal for want of rights or a rate limit is recorded once per
stretch of orphaned memory, not at each report. Without the install's policy-actions part the
operator has no rights on Nodes: nothing is read, and an enforced rule's decision is recorded
as NotPermitted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from gpuusage.api.models import OrphanedMemory
from gpuusage.api.policy import NodeRule, Target
from gpuusage.api.reasons import PolicyOutcome, policy_event_reason
from gpuusage.api.times import format_time
from gpuusage.errors import GpuusageError
from gpuusage_operator.policies.act import Result
from gpuusage_operator.policies.nodemarks import NodeMarker
from gpuusage_operator.policies.noderule import NodeMarks, due_of, node_step
from gpuusage_operator.policies.run import PARTIAL_RETRY, PolicyRunner
from gpuusage_operator.writers.marks import PodEvent

AGAIN = timedelta(seconds=10)
"""How soon a Node that could not be read or written for now is tried again."""
REREAD = timedelta(minutes=5)
"""How long the marks read from a Node are trusted before it is read again."""


class MarksLeft(GpuusageError):
    """A report's node still carries our marks: taking them off was refused for now."""


@dataclass(frozen=True)
class NodeSubject:
    finding: str
    action: str
    mode: str
    due: datetime | None


@dataclass(frozen=True)
class Stretch:
    """A stretch of orphaned memory under a policy: what its decisions are about."""

    policy: str
    subject: NodeSubject
    since: datetime | None


@dataclass(slots=True)
class NodeMemory:
    """What the node runner read and said, for one term (controller.term): another leader may
    have changed any node's marks and recorded its own decisions since this one last led."""

    known: dict[str, tuple[NodeMarks, datetime]] = field(default_factory=dict)
    """Node → the marks read from it or written on it, and when."""
    said: dict[str, tuple[str, datetime | None]] = field(default_factory=dict)
    """Node → the last outcome recorded, with the stretch of orphaned memory it was for."""


@dataclass
class NodeRunner:
    runner: PolicyRunner
    """The pods' runner: its policies, rate limits and decisions are shared."""
    record: Callable[[str, PodEvent, str, datetime], None]
    """Record an Event on the Node."""
    memory: Callable[[], NodeMemory]
    """What it read and said, the term's (controller.term)."""
    marker: NodeMarker | None = None
    """Reads and writes the Node's marks (None: no rights on Nodes)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def visit(
        self, node: str, orphaned: OrphanedMemory | None, *, certain: bool, now: datetime
    ) -> datetime | None:
        """Take the node rule's step about the node; when to look again."""
        watch = self.runner.watch
        if not watch.synced:
            return now + PARTIAL_RETRY  # a partial view neither acts nor cancels
        found = watch.node_rule()
        policy, rule = found if found is not None else (None, None)
        if rule is None and self.marker is None:
            return None
        marks = self._marks(node, now)
        if isinstance(marks, Result):
            if marks.outcome != "NotPermitted":
                return now + AGAIN
            unreadable: Result | None = marks
            marks = NodeMarks()  # without rights the operator cannot have marked it
        else:
            unreadable = None
        step = node_step(rule, orphaned, marks, certain=certain, now=now)
        if step.kind == "Wait":
            return step.until
        if step.kind == "Nothing":
            return None
        since = orphaned.since if orphaned is not None else None
        name = policy.name if policy is not None else ""
        subject = _subject(rule, orphaned)
        about = Stretch(name, subject, since)
        if step.kind == "Record":
            self._once(node, "DryRun", _would(rule), now, about)
            return None
        if unreadable is not None or self.marker is None:
            why = unreadable.detail if unreadable is not None else "no rights on Nodes"
            self._once(node, "NotPermitted", why, now, about)
            return None
        wanted = step.wanted
        later = None
        counted = None  # a taint set now is counted before it is set (see ledger.reserve)
        if wanted.tainted and not marks.tainted and name:
            slot = self.runner.ledger.reserve(name)
            if slot.retry is not None and not slot.limited:
                return slot.retry  # the counts could not be read or written: nothing done
            counted = slot.at
            if slot.limited:
                later = slot.retry
                self._once(node, "RateLimited", "taint rate-limited", now, about)
                wanted = NodeMarks(condition=wanted.condition, tainted=False)
                if wanted == marks:
                    return later
        result = self.marker.write(node, wanted, _message(orphaned, wanted), now)
        if counted is not None and result.outcome != "Done":
            self.runner.ledger.release(name, counted)
        if result.outcome == "Refused":  # a write that raced another's, or throttled
            return now + AGAIN
        if result.outcome == "Gone":
            return None  # the node went meanwhile: nothing to mark or say
        if result.outcome != "Done":
            self._once(node, result.outcome, result.detail, now, about)
            return None
        self._remember(node, wanted, now)
        outcome: PolicyOutcome = "Done" if step.kind == "Mark" else "Cleared"
        self._once(node, outcome, _message(orphaned, wanted), now, about)
        return later

    def _marks(self, node: str, now: datetime) -> NodeMarks | Result:
        with self._lock:
            known = self.memory().known.get(node)
        if known is not None and now - known[1] < REREAD:
            return known[0]
        if self.marker is None:
            return Result("NotPermitted", "policy actions are not turned on (--policy-actions)")
        found = self.marker.read(node)
        if isinstance(found, NodeMarks):
            self._remember(node, found, now)
        return found

    def _once(
        self, node: str, outcome: PolicyOutcome, note: str, now: datetime, about: Stretch
    ) -> None:
        """Record the decision and its Event, unless this stretch already has it."""
        policy = about.policy
        with self._lock:
            said = self.memory().said
            if said.get(node) == (outcome, about.since):
                return
            said[node] = (outcome, about.since)
        if policy:
            target = Target(kind="Node", name=node)
            self.runner.record_decision(policy, target, about.subject, outcome, now)
        reason = policy_event_reason(outcome)
        kind: Literal["Normal", "Warning"] = (
            "Normal" if outcome in ("Cleared", "DryRun") else "Warning"
        )
        head = f"policy {policy}: OrphanedGPUMemory" if policy else "OrphanedGPUMemory"
        text = f"{head}: {note}"
        self.record(node, PodEvent(reason, text, kind), text, now)

    def forget(self, node: str, now: datetime) -> None:
        """The node's report is gone (the agent uninstalled, the node deleted): nothing is
        known of its memory any more, so marks of ours on it are taken off. A node this term
        has not read is read first (the report may have gone while another replica led, or
        none did, after marking it), and what was read or written is remembered like any
        node's, so that a report queued again and again costs no read each time."""
        with self._lock:
            self.memory().said.pop(node, None)
        if self.marker is None:
            return
        marks = self._marks(node, now)
        if isinstance(marks, Result):
            if marks.outcome == "Refused":
                raise MarksLeft(f"node {node}: {marks.detail}")
            self._remember(node, None, now)  # gone, or no right to read it: nothing of ours
            return
        if marks != NodeMarks():
            done = self.marker.write(node, NodeMarks(), _message(None, NodeMarks()), now)
            if done.outcome == "Refused":  # raced another write, or throttled: retried
                raise MarksLeft(f"node {node}: {done.detail}")
            if done.outcome != "Done":
                self._remember(node, None, now)
                return
        self._remember(node, NodeMarks(), now)

    def _remember(self, node: str, marks: NodeMarks | None, now: datetime) -> None:
        with self._lock:
            if marks is None:
                self.memory().known.pop(node, None)
            else:
                self.memory().known[node] = (marks, now)


def _subject(rule: NodeRule | None, orphaned: OrphanedMemory | None) -> NodeSubject:
    return NodeSubject(
        "OrphanedGPUMemory",
        rule.action if rule is not None else "Notify",
        rule.mode if rule is not None else "DryRun",
        due_of(rule, orphaned),
    )


def _would(rule: NodeRule | None) -> str:
    taint = rule is not None and rule.action == "Taint"
    what = "set the node condition and the NoSchedule taint" if taint else "set the condition"
    return f"would {what} now (DryRun: nothing done)"


def _message(orphaned: OrphanedMemory | None, wanted: NodeMarks) -> str:
    if not wanted.condition or orphaned is None:
        return "the orphaned GPU memory was freed (or the rule no longer applies)"
    since = format_time(orphaned.since) if orphaned.since else "now"
    taint = "; NoSchedule taint set" if wanted.tainted else ""
    return (
        f"{orphaned.memory_mib} MiB of GPU memory held by {orphaned.processes} processes of no "
        f"live pod since {since}{taint}"
    )
