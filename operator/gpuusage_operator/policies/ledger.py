"""Each GpuUsagePolicy's status as the leader writes it: the decisions to record, and the
enforced actions the rate limits count.

Every write is built on the policy as its watch holds it (informers.policywatch), never on a
read of its own, and names that resourceVersion: one built on a status changed meanwhile (the
spec edited; another leader, across a handover this replica did not notice) is refused (409)
instead of writing over it, and waits for a later flush, when the watch has brought the change.
A write's answer goes to the watch's state at once, so the next write builds on it and the
next count includes it. A fault leaves the status behind, never wrong:

* Decisions not written wait for a flush at least STATUS_RETRY later (a reconcile's or the
  housekeeping pass's): every done one, and of the others the newest the status can list. One
  the status lists already (a write whose answer was lost had landed) is neither listed nor
  counted again. A status refused for good (no right to it, the policy gone, a body refused)
  keeps nothing back: the decisions are logged and dropped.
* An enforced action is counted in `status.actedAt` before it is taken (`reserve`), one at a
  time, so two workers never both take the last slot and a leader that stops right after
  acting leaves the next one its count; an action then not taken gives its slot back
  (`release`). Times are whole seconds, as the status holds them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from gpuusage.api import names
from gpuusage.api.policy import MAX_DECISIONS, Decision, GpuUsagePolicySpec
from gpuusage.api.times import format_time
from gpuusage.kube.errors import Conflict, Forbidden, Invalid, NotFound, translate
from gpuusage_operator.informers.policywatch import Policy, PolicyWatch
from gpuusage_operator.policies.limit import next_allowed, recent

log = logging.getLogger(__name__)

STATUS_RETRY = timedelta(seconds=5)
"""How soon what could not be counted or written in a policy's status is tried again (the
reconcile that took the decisions is run again then, though its report does not change)."""
GONE_RETRY = timedelta(seconds=1)
"""How soon an action whose policy went meanwhile is looked at again (to be called off)."""


@dataclass(frozen=True)
class Slot:
    """What reserving an action gave: its counted time (taken), or when to try again, for the
    rate limits (limited) or because the counts could not be read or written."""

    at: datetime | None = None
    retry: datetime | None = None
    limited: bool = False


def mode_of(spec: GpuUsagePolicySpec) -> str:
    modes = {r.mode for r in spec.rules} | {r.mode for r in spec.node_rules}
    return modes.pop() if len(modes) == 1 else "Mixed"


def rules_of(spec: GpuUsagePolicySpec) -> str:
    listed = [f"{r.finding}>{r.action}" for r in spec.rules]
    listed += [f"{r.finding}>{r.action}" for r in spec.node_rules]
    return ",".join(listed)[:256]


def status_of(policy: Policy, decisions: list[Decision], now: datetime) -> dict[str, Any]:
    """The policy's status with the decisions written in (newest first, at most MAX_DECISIONS;
    none the status lists already), its mode, rules, actions taken and counted."""
    fresh = [
        dumped
        for d in reversed(decisions)
        if (dumped := d.model_dump(by_alias=True, mode="json", exclude_defaults=True))
        not in policy.decisions
    ]
    now = max((d.decided_at for d in decisions), default=now)
    return {
        "observedGeneration": policy.generation,
        "mode": mode_of(policy.spec),
        "rules": rules_of(policy.spec),
        "actionsTaken": policy.actions_taken + sum(1 for d in fresh if d.get("done")),
        "decisions": (fresh + list(policy.decisions))[:MAX_DECISIONS],
        "actedAt": [format_time(t) for t in recent(policy.acted_at, now)],
    }


Written = Literal["Written", "Unlisted", "Conflict", "Failed", "Refused"]
"""What became of a status write: landed; landed as the policies are listed again (the state
that replaces the watch's may not show it); refused as built on an older version (409); failed
for now (it may have landed all the same); refused for good."""


@dataclass
class PolicyLedger:
    watch: PolicyWatch
    custom: Any
    """A CustomObjectsApi: the policies' status is written through it."""
    clock: Callable[[], datetime]
    cluster_actions_per_hour: int
    _pending: dict[str, list[Decision]] = field(default_factory=dict)
    _retry_at: datetime | None = None
    """No flush before then: the last one could not write everything (see flush)."""
    _refused: set[tuple[str, int]] = field(default_factory=set)
    """(policy, generation) whose status the apiserver refused for good: its mode and rules
    are not tried again (nor said again) until it changes."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the fields above (never held across a request)."""
    _writing: threading.Lock = field(default_factory=threading.Lock)
    """Held while a status write is built and made: one at a time, each built on what the one
    before it left (two at once, the version would refuse the second)."""

    def add(self, policy: str, decision: Decision) -> None:
        """A decision for the policy's status, written by the next flush."""
        with self._lock:
            self._pending.setdefault(policy, []).append(decision)

    def acted(self, now: datetime) -> dict[str, list[datetime]] | None:
        """Each policy's counted actions of the last hour (a policy gone counts for the
        cluster's limit while its times do); None while the policies are not listed."""
        return self.watch.acted(now)

    def reserve(self, policy: str) -> Slot:
        """Count one of the policy's enforced actions, about to be taken now, in its status;
        the slot says whether to take it (see the module's docstring)."""
        with self._writing:
            now = self.clock().replace(microsecond=0)
            found = self.watch.policy(policy)
            if found is None:
                return Slot(retry=now + GONE_RETRY)
            counted = self.watch.acted(now)
            if counted is None:
                return Slot(retry=now + STATUS_RETRY)
            later = next_allowed(
                policy,
                counted,
                per_policy=found.spec.max_actions_per_hour,
                cluster=self.cluster_actions_per_hour,
                now=now,
            )
            if later is not None:
                return Slot(retry=later, limited=True)
            acted = [format_time(t) for t in [*recent(found.acted_at, now), now]]
            if self._write(found, {"actedAt": acted}) != "Written":
                return Slot(retry=now + STATUS_RETRY)  # not counted (or not seen): not taken
            return Slot(at=now)

    def release(self, policy: str, at: datetime) -> None:
        """The action counted at `at` was not taken (refused, gone, not applicable): its count
        is written off at once, so the next reservation has the slot. Not written, it stays
        counted for its hour (fewer actions, never more)."""
        with self._writing:
            found = self.watch.policy(policy)
            if found is None or at not in found.acted_at:
                return
            acted = list(found.acted_at)
            acted.remove(at)
            self._write(found, {"actedAt": [format_time(t) for t in acted]})

    def flush(self) -> None:
        """Write the decisions added since the last flush into their policies' status, and a
        new or edited policy's mode and rules. After a write that did not land no flush tries
        before STATUS_RETRY (a status that cannot be written is not asked at every reconcile);
        the housekeeping pass flushes too, so what waits is written though no reconcile comes.
        While another write is under way, what is added waits for the next flush (no worker
        queues behind a slow status)."""
        now = self.clock()
        with self._lock:
            due = self._retry_at
            if due is not None and now < due <= now + STATUS_RETRY:  # (a clock set back: due)
                return
        if not self._writing.acquire(blocking=False):
            return
        try:
            failed = self._flush()
        finally:
            self._writing.release()
        with self._lock:
            self._retry_at = now + STATUS_RETRY if failed else None

    def waiting(self) -> bool:
        """Whether decisions (or a policy's mode and rules) wait to be written."""
        with self._lock:
            return bool(self._pending)

    def _flush(self) -> bool:
        """Flush, under `_writing`; whether a write did not land."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for name in self.watch.policies.state.ids() - set(pending):
            policy = self.watch.policy(name)
            refused = policy is not None and (name, policy.generation) in self._refused
            if policy is not None and policy.observed != policy.generation and not refused:
                pending[name] = []  # new or edited: its mode and rules are shown at once
        failed = False
        for name, decisions in pending.items():
            policy = self.watch.policy(name)
            if policy is None:
                continue  # gone: nothing to write its decisions into
            try:
                written = self._write(policy, status_of(policy, decisions, self.clock()))
            except Exception:  # kept for the next flush: nothing taken out is lost
                log.exception("GpuUsagePolicy %s: status not written", name)
                written = "Failed"
            if written in ("Written", "Unlisted"):
                continue
            if written != "Refused":
                failed = True
                self._keep(name, decisions)
                continue
            self._refused.add((name, policy.generation))  # it would never be written
            if decisions:
                log.error("GpuUsagePolicy %s: %d decisions not recorded", name, len(decisions))
        return failed

    def _keep(self, name: str, decisions: list[Decision]) -> None:
        """Decisions not written wait for the next flush, before those added since: every done
        one (actionsTaken counts it; the rate limits bound the enforced ones, the pods the
        notices), of the others the newest the status lists. A policy whose mode and rules
        alone were not written waits too."""
        with self._lock:
            waiting = decisions + self._pending.get(name, [])
            room = MAX_DECISIONS - sum(1 for d in waiting if d.done)
            others = [i for i, d in enumerate(waiting) if not d.done]
            dropped = set(others[: max(0, len(others) - room)])
            if dropped:
                log.warning(
                    "GpuUsagePolicy %s: %d decisions not recorded: its status cannot be written",
                    name,
                    len(dropped),
                )
            self._pending[name] = [d for i, d in enumerate(waiting) if i not in dropped]

    def _write(self, policy: Policy, patch: dict[str, Any]) -> Written:
        """Merge `patch`, built on `policy` as the watch holds it, into its status (refused,
        409, when the status changed since); its answer goes to the watch's state."""
        if not policy.version:  # never served so: no write without its precondition
            return "Failed"
        body = {"metadata": {"resourceVersion": policy.version}, "status": patch}
        try:
            answer = self.custom.patch_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, policy.name, body
            )
        except Exception as exc:
            error = translate(exc)
            if isinstance(error, Conflict):
                return "Conflict"
            log.warning("GpuUsagePolicy %s: status not written: %s", policy.name, error)
            return "Refused" if isinstance(error, Forbidden | NotFound | Invalid) else "Failed"
        listed = self.watch.wrote(policy.name, policy.version, answer)
        return "Written" if listed else "Unlisted"
