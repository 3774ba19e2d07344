"""Policies carried out: the thin edge between policies.rule's steps and the API.

Each reconcile asks the runner about each pod it judged (visit), with the pod's finding as the
judge observed it (see judge.findings), once the pod's marks state it; the runner takes the one
step the covering policy wants (see policies.rule), writes the pod's announcement annotation
and an Event, and hands the decision to the ledger (see policies.ledger), which the reconcile
flushes into the policy's status once it has visited its pods; an enforced action is counted
there before it is taken. A step that writes the pod first takes its write from the
cluster-wide budget of pod writes (see writers.budget): over it, the step waits for a later
reconcile, with no Event and nothing decided. This version carries out DryRun and Notify; an
enforced ScaleToZero, Suspend, DeletePod or Evict is carried out by an Actor (see
policies.act), which the operator has only with --policy-actions and the install's
policy-actions part (the rights these need); without it the decision is recorded as
NotPermitted, with a Warning Event, and nothing is attempted. An action refused for now (a
PodDisruptionBudget) is tried again BLOCKED_RETRY later; one over the rate limits (see
policies.limit) when they allow it; one the ledger could not count, a few seconds later, with
nothing done or said meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as TallyCounter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from gpuusage.api import names
from gpuusage.api.announcement import Announcement, decode, encode
from gpuusage.api.policy import Decision, Target
from gpuusage.api.reasons import PolicyOutcome, policy_event_reason
from gpuusage.api.times import format_time
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.informers.policywatch import PolicyWatch
from gpuusage_operator.judge.findings import Observation
from gpuusage_operator.policies.act import Actor, Result
from gpuusage_operator.policies.ledger import PolicyLedger
from gpuusage_operator.policies.limit import CLUSTER_ACTIONS_PER_HOUR
from gpuusage_operator.policies.rule import Step, next_step
from gpuusage_operator.policies.select import opt_out_hint, opted_out
from gpuusage_operator.writers.marks import PodEvent

log = logging.getLogger(__name__)

NOTICE = timedelta(minutes=5)
"""The least warning an announcement gives before its deadline (--policy-notice)."""
WHAT = {
    "Notify": "tell its owner (an Event)",
    "ScaleToZero": "scale its workload to zero",
    "Suspend": "suspend its Job",
    "DeletePod": "delete the pod",
    "Evict": "evict the pod",
}
BLOCKED_RETRY = timedelta(minutes=1)
"""How long after an action refused for now (a PodDisruptionBudget) it is tried again."""
PARTIAL_RETRY = timedelta(seconds=1)
"""How soon a subject met while the policies are being listed (again, after the API was
away) is looked at again: its report may not change for a long time, and a step due meanwhile
(an announcement's deadline) must not wait for that."""


class Subject(Protocol):
    """What a decision is about: a rule's finding and action, and when it is due."""

    @property
    def finding(self) -> str: ...
    @property
    def action(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def due(self) -> datetime | None: ...


@dataclass
class PolicyRunner:
    watch: PolicyWatch
    custom: Any
    """A CustomObjectsApi: the ledger writes the policies' status through it (and reads it
    from the watch only)."""
    annotate: Callable[[PodSnapshot, dict[str, str | None]], bool]
    """Patch the pod's annotations (with its UID as precondition); whether it landed."""
    record: Callable[[PodSnapshot, PodEvent, str, datetime], None]
    """Record an Event on the pod."""
    notice: timedelta = NOTICE
    admit: Callable[[PodSnapshot], bool] = lambda pod: True
    """Whether the cluster-wide budget of pod writes allows one more on this pod now (taken
    from it): every step that writes the pod asks first, and waits for a later reconcile
    when it does not."""
    actor: Actor | None = None
    """Carries out enforced actions other than Notify (None: not turned on)."""
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    """Now, for the ledger: when an enforced action is counted, and the window of
    status.actedAt."""
    cluster_actions_per_hour: int = CLUSTER_ACTIONS_PER_HOUR
    """All policies' enforced actions (but Notify) in any sliding hour."""
    decided: TallyCounter[tuple[str, str, str]] = field(default_factory=TallyCounter)
    """Decisions taken by this replica, by (policy, action, outcome): the metric's counts."""
    ledger: PolicyLedger = field(init=False)
    """The policies' status: decisions recorded, enforced actions counted (see ledger)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.ledger = PolicyLedger(
            self.watch, self.custom, self.clock, self.cluster_actions_per_hour
        )

    def visit(self, pod: PodSnapshot, seen: Observation, now: datetime) -> datetime | None:
        """Take the covering policy's next step about the pod, whose finding the judge
        observed as `seen` and its marks now state; when to look again."""
        if not self.watch.synced:
            return now + PARTIAL_RETRY  # a partial view neither acts nor cancels
        ours = pod.our_annotations
        shown = decode(ours.get(names.ANNOTATION_POLICY_ACTION))
        policy, namespace_exempt = self.watch.covering(pod.namespace, dict(pod.labels))
        if shown is not None and (policy is None or shown.policy != policy.name):
            # the announcement's policy no longer covers the pod (deleted, reselected)
            gone = self.watch.policy(shown.policy)
            step = Step("Cancel", why="RuleRemoved")
            if self._take(pod, step, shown, gone is not None, now) is not None:
                return None  # not written (the budget): called off at a later reconcile
            shown = None
        if policy is None:
            return None
        step = next_step(
            policy.name,
            policy.spec.rules,
            seen,
            shown,
            exempt=opted_out(policy.spec, ours, namespace_exempt),
            now=now,
            notice=self.notice,
        )
        left = self._take(pod, step, shown, True, now, hint=opt_out_hint(policy.spec))
        if left is None or left.recorded:
            return None
        return left.due  # looked at again when due, though no report changes

    def _take(
        self,
        pod: PodSnapshot,
        step: Step,
        shown: Announcement | None,
        known: bool,
        now: datetime,
        *,
        hint: str = "",
    ) -> Announcement | None:
        """Carry out the step; the announcement the pod carries afterwards (`hint`: how the
        owner may opt out, told with an announcement)."""
        subject = step.announcement or shown
        if step.kind in ("Wait", "Hold", "Nothing") or subject is None:
            return step.announcement
        if not self.admit(pod):
            return shown  # over the budget of pod writes: taken at a later reconcile
        what = WHAT.get(subject.action, subject.action)
        head = f"policy {subject.policy}: {subject.finding}"
        if step.kind == "Cancel":
            if not self.annotate(pod, {names.ANNOTATION_POLICY_ACTION: None}):
                return shown
            if subject.recorded and subject.mode == "Enforce":
                return None  # taken (or given up) already: nothing is called off
            why = {
                "FindingCleared": "the finding cleared",
                "Exempt": "the pod or its namespace opted out",
            }.get(step.why, "the policy no longer covers the pod")
            note = f"{head}: will not {what}: {why}"
            self.record(pod, PodEvent("GPUPolicyCancelled", note), note, now)
            if known:
                self._record_pod_decision(pod, subject, "Cancelled", now)
            return None
        assert step.announcement is not None  # the other steps carry one
        announced = step.announcement
        if step.kind == "Announce":
            note = (
                f"{head} since {format_time(announced.since)}: will {what} at "
                f"{format_time(announced.due)} ({announced.mode}); {hint}"
            )
            if not self.annotate(pod, {names.ANNOTATION_POLICY_ACTION: encode(announced)}):
                return shown
            self.record(pod, PodEvent("GPUPolicyPending", note, "Warning"), note, now)
            self._record_pod_decision(pod, announced, "Pending", now)
            return announced
        if step.kind == "Record":
            note = f"{head}: would {what} now (DryRun: nothing done)"
            if not self.annotate(pod, {names.ANNOTATION_POLICY_ACTION: encode(announced)}):
                return shown
            self.record(pod, PodEvent("GPUPolicyDryRun", note), note, now)
            self._record_pod_decision(pod, announced, "DryRun", now)
            return announced
        done = replace(announced, recorded=True)
        if announced.action == "Notify":
            note = f"{head} for {announced.after} or more"
            if not self.annotate(pod, {names.ANNOTATION_POLICY_ACTION: encode(done)}):
                return shown
            self.record(pod, PodEvent("GPUPolicyNotice", note, "Warning"), note, now)
            self._record_pod_decision(pod, done, "Done", now)
            return done
        limited: datetime | None = None
        if self.actor is None:
            result = Result(
                "NotPermitted",
                "policy actions are not turned on (--policy-actions, with the install's "
                "policy-actions part)",
            )
        else:
            slot = self.ledger.reserve(announced.policy)
            if slot.retry is not None and not slot.limited:
                return replace(announced, due=slot.retry)  # not counted: nothing done or said
            if slot.at is None:
                limited = slot.retry
                result = Result("RateLimited", "its actions per hour (policy or cluster) are spent")
            else:
                result = self.actor.act(pod.namespace, pod.name, pod.uid, announced.action)
                if result.outcome != "Done":
                    self.ledger.release(announced.policy, slot.at)
        if result.outcome == "Gone":
            return None  # the pod or its owner went meanwhile: nothing to act on or say
        if result.outcome in ("Refused", "RateLimited"):
            later = replace(announced, due=limited or now + BLOCKED_RETRY)
            self.annotate(pod, {names.ANNOTATION_POLICY_ACTION: encode(later)})
            again = format_time(later.due)
            note = f"{head}: could not {what} yet: {result.detail}; trying again at {again}"
            reason = policy_event_reason(result.outcome)
            self.record(pod, PodEvent(reason, note, "Warning"), note, now)
            self._record_pod_decision(pod, later, result.outcome, now)
            return later
        self.annotate(pod, {names.ANNOTATION_POLICY_ACTION: encode(done)})
        reason = policy_event_reason(result.outcome)
        if result.outcome == "Done":
            note = f"{head}: {result.detail}"
        else:
            note = f"{head}: would {what}, but {result.detail}; nothing done"
        self.record(pod, PodEvent(reason, note, "Warning"), note, now)
        self._record_pod_decision(pod, done, result.outcome, now)
        return done

    def _record_pod_decision(
        self, pod: PodSnapshot, subject: Announcement, outcome: PolicyOutcome, now: datetime
    ) -> None:
        self.record_decision(
            subject.policy,
            Target(kind="Pod", namespace=pod.namespace, name=pod.name, uid=pod.uid),
            subject,
            outcome,
            now,
        )

    def record_decision(
        self, policy: str, target: Target, subject: Subject, outcome: PolicyOutcome, now: datetime
    ) -> None:
        """Remember a decision for the policy's status and the metric."""
        decision = Decision(
            target=target,
            finding=subject.finding,
            action=subject.action,
            mode="Enforce" if subject.mode == "Enforce" else "DryRun",
            decided_at=now,
            due_at=subject.due,
            done=outcome == "Done",
            outcome=outcome,
        )
        self.ledger.add(policy, decision)
        with self._lock:
            self.decided[policy, subject.action, outcome] += 1
