"""Policies carried out: the thin edge between policies.rule's steps and the API.

Each reconcile asks the runner about each pod it judged (visit), with the pod's finding as the
judge observed it (see judge.findings), once the pod's marks state it; the runner takes the one
step the covering policy wants (see policies.rule), writes the pod's announcement annotation
and an Event, and remembers the decision for the policy's status, which `flush` writes once per
reconcile. A step that writes the pod first takes its write from the cluster-wide budget of pod
writes (see debounce): over it, the step waits for a later reconcile, with no Event and nothing
decided. This version carries out DryRun and Notify; an enforced ScaleToZero, Suspend,
DeletePod or Evict is carried out by an Actor (see policies.act), which the operator has only
with --policy-actions and the install's policy-actions part (the rights these need); without it
the decision is recorded as NotPermitted, with a Warning Event, and nothing is attempted. An
action refused for now (a PodDisruptionBudget) is tried again BLOCKED_RETRY later; one over the
rate limits (see policies.limit) when they allow it.
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
from gpuusage.api.policy import MAX_DECISIONS, Decision, GpuUsagePolicySpec, Target
from gpuusage.api.reasons import PolicyOutcome, policy_event_reason
from gpuusage.api.times import format_time, parse_time
from gpuusage.kube.errors import NotFound, translate
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.informers.policies import PolicyWatch
from gpuusage_operator.judge.findings import Observation
from gpuusage_operator.policies.act import Actor, Result
from gpuusage_operator.policies.limit import CLUSTER_ACTIONS_PER_HOUR, next_allowed, recent
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
STATUS_RETRY = timedelta(seconds=5)
"""How soon decisions whose policy's status could not be read or written are written again
(the reconcile that took them is run again then, though its report does not change)."""


@dataclass(frozen=True)
class Slot:
    """What reserving an action gave: taken (retry None), or when to try again, for the rate
    limits (limited) or because the counts could not be read or written."""

    retry: datetime | None = None
    limited: bool = False


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


def mode_of(spec: GpuUsagePolicySpec) -> str:
    modes = {r.mode for r in spec.rules} | {r.mode for r in spec.node_rules}
    return modes.pop() if len(modes) == 1 else "Mixed"


def rules_of(spec: GpuUsagePolicySpec) -> str:
    listed = [f"{r.finding}>{r.action}" for r in spec.rules]
    listed += [f"{r.finding}>{r.action}" for r in spec.node_rules]
    return ",".join(listed)[:256]


@dataclass
class PolicyRunner:
    watch: PolicyWatch
    custom: Any
    """A CustomObjectsApi: the policies' status is written through it."""
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
    """Now, for a status written without a decision (the window of status.actedAt)."""
    cluster_actions_per_hour: int = CLUSTER_ACTIONS_PER_HOUR
    """All policies' enforced actions (but Notify) in any sliding hour."""
    decided: TallyCounter[tuple[str, str, str]] = field(default_factory=TallyCounter)
    """Decisions taken by this replica, by (policy, action, outcome): the metric's counts."""
    _pending: dict[str, list[Decision]] = field(default_factory=dict)
    _written: dict[str, tuple[list[dict[str, Any]], int]] = field(default_factory=dict)
    _acted: dict[str, list[datetime]] = field(default_factory=dict)
    """Each policy's counted actions, by policy (see _counted)."""
    _shown: dict[str, int] = field(default_factory=dict)
    """The generation whose mode and rules this replica last wrote, by policy."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reserving: threading.Lock = field(default_factory=threading.Lock)
    """Held while the counted actions are checked and written (see reserve)."""

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
            slot = self.reserve(announced.policy, now)
            if slot.retry is not None and not slot.limited:
                return replace(announced, due=slot.retry)  # not counted: nothing done or said
            if slot.retry is not None:
                limited = slot.retry
                result = Result("RateLimited", "its actions per hour (policy or cluster) are spent")
            else:
                result = self.actor.act(pod.namespace, pod.name, pod.uid, announced.action)
                if result.outcome != "Done":
                    self.release(announced.policy, now)
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

    def acted(self, now: datetime) -> dict[str, list[datetime]] | None:
        """Each policy's counted actions of the last hour (None while one's status cannot be
        read: the cluster-wide limit needs them all)."""
        counted: dict[str, list[datetime]] = {}
        existing = self.watch.policies.state.ids()
        with self._lock:  # a policy gone counts for the cluster's limit while its times do
            for gone in [n for n, t in self._acted.items() if n not in existing and not t]:
                del self._acted[gone]
            known = set(self._acted)
        for name in known | existing:
            times = self._counted(name, now)
            if times is None:
                return None
            counted[name] = times
        return counted

    def _counted(self, name: str, now: datetime) -> list[datetime] | None:
        """The policy's counted actions of the last hour: read from its status once (after a
        start or a takeover: they are every replica's, as each is written there before it is
        taken), then this replica's memory of them, as only the leader takes and writes them;
        None while the status cannot be read."""
        with self._lock:
            times = self._acted.get(name)
        if times is None:
            stored = self._read_status(name)
            if stored is None:
                return None
            read = (parse_time(t) for t in stored.get("actedAt") or [])
            with self._lock:
                times = self._acted.setdefault(name, [t for t in read if t is not None])
        with self._lock:
            times[:] = recent(times, now)
            return list(times)

    def reserve(self, policy: str, now: datetime) -> Slot:
        """One of the policy's enforced actions, to be taken now: counted, in this replica and
        in the policy's status, before it is taken, so that a replica that stops right after
        it leaves the next leader a count of it (a slot counted for an action never taken errs
        towards fewer actions, never more). Reservations are made one at a time, so two
        workers never both take the last slot, and the status written lists each."""
        with self._reserving:
            counted = self.acted(now)
            if counted is None:
                return Slot(now + STATUS_RETRY)
            found = self.watch.policy(policy)
            later = next_allowed(
                policy,
                counted,
                per_policy=found.spec.max_actions_per_hour if found is not None else 0,
                cluster=self.cluster_actions_per_hour,
                now=now,
            )
            if later is not None:
                return Slot(later, limited=True)
            with self._lock:
                self._acted.setdefault(policy, []).append(now)
                times = list(self._acted[policy])
            try:
                self.custom.patch_cluster_custom_object_status(
                    names.GROUP,
                    names.VERSION,
                    names.POLICY_PLURAL,
                    policy,
                    {"status": {"actedAt": [format_time(t) for t in times]}},
                )
            except Exception as exc:  # not counted where the next leader reads: not taken
                log.warning("GpuUsagePolicy %s: action not counted, taken later: %s", policy, exc)
                self.release(policy, now)
                return Slot(now + STATUS_RETRY)
            return Slot()

    def release(self, policy: str, now: datetime) -> None:
        """The action reserved at `now` was not taken (refused, gone, not applicable): not
        counted; the next status written drops it."""
        with self._lock:
            times = self._acted.get(policy, [])
            if now in times:
                times.remove(now)

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
        with self._lock:
            self._pending.setdefault(policy, []).append(decision)
            self.decided[policy, subject.action, outcome] += 1

    def flush(self) -> bool:
        """Write the decisions taken since the last flush into their policies' status (newest
        first, at most MAX_DECISIONS), with the mode, the rules and the actions taken; whether
        some wait for a later flush. A status that cannot be read or written keeps its
        decisions for the next flush, and is read back before it: a write whose answer was
        lost may have landed, and a decision it already lists is neither listed nor counted
        twice (a fault leaves the status behind, never wrong)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        known = self.watch.policies.state.ids()
        for table in (self._written, self._shown):  # nothing kept of policies gone
            for gone in set(table) - known:
                del table[gone]
        for name in known - set(pending):
            policy = self.watch.policy(name)
            shown = policy is not None and self._shown.get(name) == policy.generation
            if policy is not None and policy.observed != policy.generation and not shown:
                pending[name] = []  # new or changed: its mode and rules are shown at once
        waiting = False
        for name, decisions in pending.items():
            policy = self.watch.policy(name)
            if policy is None:
                continue
            base = self._written.get(name) or self._stored(name)
            if base is None:
                waiting = self._keep(name, decisions) or waiting
                continue
            earlier, taken = base
            fresh = [
                dumped
                for d in reversed(decisions)
                if (dumped := d.model_dump(by_alias=True, mode="json", exclude_defaults=True))
                not in earlier
            ]
            listed = (fresh + earlier)[:MAX_DECISIONS]
            taken += sum(1 for d in fresh if d.get("done"))
            now = max((d.decided_at for d in decisions), default=self.clock())
            status: dict[str, Any] = {
                "observedGeneration": policy.generation,
                "mode": mode_of(policy.spec),
                "rules": rules_of(policy.spec),
                "actionsTaken": taken,
                "decisions": listed,
            }
            try:
                with self._reserving:  # no reservation written meanwhile is written over
                    times = self._counted(name, now)
                    if times is not None:  # else left as it is
                        status["actedAt"] = [format_time(t) for t in times]
                    self.custom.patch_cluster_custom_object_status(
                        names.GROUP,
                        names.VERSION,
                        names.POLICY_PLURAL,
                        name,
                        {"status": status},
                    )
            except Exception as exc:  # the status is a record; the pods carry the truth
                log.warning("GpuUsagePolicy %s: status not written: %s", name, exc)
                self._written.pop(name, None)  # it may have landed: read back next time
                if not decisions:  # its mode and rules alone: tried again when it changes
                    self._shown[name] = policy.generation
                waiting = self._keep(name, decisions) or waiting
                continue
            self._written[name] = (listed, taken)
            self._shown[name] = policy.generation
        return waiting

    def _keep(self, name: str, decisions: list[Decision]) -> bool:
        """Decisions not written yet wait for the next flush, before those taken since."""
        if not decisions:
            return False
        with self._lock:
            self._pending[name] = decisions + self._pending.get(name, [])
        return True

    def forget_written(self) -> None:
        """This replica acts again after standing by: another may have written the policies'
        status meanwhile, so each is read back before this one writes it again."""
        self._written.clear()
        self._shown.clear()
        with self._lock:
            self._acted.clear()

    def _stored(self, name: str) -> tuple[list[dict[str, Any]], int] | None:
        """What the policy's status lists and counts now (None: it cannot be read, so it is
        not written either: what it lists and counts would be lost)."""
        status = self._read_status(name)
        if status is None:
            return None
        return list(status.get("decisions") or []), int(status.get("actionsTaken") or 0)

    def _read_status(self, name: str) -> dict[str, Any] | None:
        """The policy's status as the apiserver has it now ({} for a policy gone); None when
        it cannot be read."""
        try:
            body = self.custom.get_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, name
            )
        except Exception as exc:
            if isinstance(translate(exc), NotFound):
                return {}
            log.warning("GpuUsagePolicy %s: status not read, tried again later: %s", name, exc)
            return None
        return dict((body or {}).get("status") or {})
