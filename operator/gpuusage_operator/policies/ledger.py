"""Each GpuUsagePolicy's status as the leader keeps it: the decisions to record, the enforced
actions the rate limits count, and the writes that keep the status true through faults and
handovers.

Only the leader writes a policy's status, and it keeps what it last read or wrote of it (read
once after a start or a takeover, then its own writes). Every write names that
resourceVersion, so a write built on a status another replica changed meanwhile (a leader
that lost the lead and won it back within one reconcile) is refused (409) and the status read
back. A fault leaves the status behind, never wrong:

* Decisions whose write failed wait for the next flush (STATUS_RETRY later), and the status is
  read back first: a decision that a write whose answer was lost had recorded is neither listed
  nor counted twice. A status the apiserver refuses for good (no right to it, the policy gone,
  a body refused) keeps nothing back: the decisions are logged and dropped.
* An enforced action is counted in `status.actedAt` before it is taken (`reserve`), one at a
  time, so two workers never both take the last slot and a leader that stops right after
  acting leaves the next one its count; an action then not taken gives its slot back
  (`release`). Times are whole seconds, as the status holds them: what is counted compares
  equal to what is read back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api import names
from gpuusage.api.policy import MAX_DECISIONS, Decision, GpuUsagePolicySpec
from gpuusage.api.times import format_time, parse_time
from gpuusage.kube.errors import Forbidden, Invalid, NotFound, translate
from gpuusage_operator.informers.policies import PolicyWatch
from gpuusage_operator.policies.limit import next_allowed, recent

log = logging.getLogger(__name__)

STATUS_RETRY = timedelta(seconds=5)
"""How soon what could not be read or written in a policy's status is tried again (the
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


@dataclass
class _Status:
    """A policy's status as this replica last read or wrote it."""

    version: str
    decisions: list[dict[str, Any]]
    taken: int
    acted: list[datetime]


def mode_of(spec: GpuUsagePolicySpec) -> str:
    modes = {r.mode for r in spec.rules} | {r.mode for r in spec.node_rules}
    return modes.pop() if len(modes) == 1 else "Mixed"


def rules_of(spec: GpuUsagePolicySpec) -> str:
    listed = [f"{r.finding}>{r.action}" for r in spec.rules]
    listed += [f"{r.finding}>{r.action}" for r in spec.node_rules]
    return ",".join(listed)[:256]


@dataclass
class PolicyLedger:
    watch: PolicyWatch
    custom: Any
    """A CustomObjectsApi: the policies' status is read and written through it."""
    clock: Callable[[], datetime]
    cluster_actions_per_hour: int
    _pending: dict[str, list[Decision]] = field(default_factory=dict)
    _known: dict[str, _Status] = field(default_factory=dict)
    _shown: dict[str, int] = field(default_factory=dict)
    """The generation whose mode and rules this replica last wrote, by policy."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the tables above (never held across a request)."""
    _writing: threading.Lock = field(default_factory=threading.Lock)
    """Held while a status is read, decided on and written: one write at a time, each built
    on what the one before it left (two at once, the version would refuse the second)."""

    def add(self, policy: str, decision: Decision) -> None:
        """A decision for the policy's status, written by the next flush."""
        with self._lock:
            self._pending.setdefault(policy, []).append(decision)

    def forget(self) -> None:
        """This replica leads again after standing by: another may have written meanwhile, so
        each status is read back before this one writes it again. (Called by the write fence,
        possibly within a write of this ledger: it takes no lock a write holds.)"""
        with self._lock:
            self._known.clear()
            self._shown.clear()

    def acted(self, now: datetime) -> dict[str, list[datetime]] | None:
        """Each policy's counted actions of the last hour (a policy gone counts for the
        cluster's limit while its times do); None while one's status cannot be read."""
        existing = self.watch.policies.state.ids()
        with self._lock:
            for gone in [n for n, s in self._known.items() if n not in existing]:
                if not recent(self._known[gone].acted, now):
                    del self._known[gone]
            names_ = set(self._known) | existing
        counted: dict[str, list[datetime]] = {}
        for name in names_:
            status = self._status(name)
            if status is None:
                return None
            counted[name] = recent(status.acted, now)
        return counted

    def reserve(self, policy: str) -> Slot:
        """Count one of the policy's enforced actions, about to be taken now, in its status;
        the slot says whether to take it (see the module's docstring)."""
        with self._writing:
            now = self.clock().replace(microsecond=0)
            found = self.watch.policy(policy)
            if found is None:
                return Slot(retry=now + GONE_RETRY)
            status = self._status(policy)  # what the write is built on, and its version
            counted = self.acted(now)
            if status is None or counted is None:
                return Slot(retry=now + STATUS_RETRY)
            counted[policy] = recent(status.acted, now)
            later = next_allowed(
                policy,
                counted,
                per_policy=found.spec.max_actions_per_hour,
                cluster=self.cluster_actions_per_hour,
                now=now,
            )
            if later is not None:
                return Slot(retry=later, limited=True)
            acted = [format_time(t) for t in [*counted[policy], now]]
            if not self._write(policy, status.version, {"actedAt": acted}):
                return Slot(retry=now + STATUS_RETRY)  # not counted: not taken
            return Slot(at=now)

    def release(self, policy: str, at: datetime) -> None:
        """The action counted at `at` was not taken (refused, gone, not applicable): the next
        write of the status drops it."""
        with self._writing, self._lock:
            status = self._known.get(policy)
            if status is not None and at in status.acted:
                status.acted.remove(at)

    def flush(self) -> bool:
        """Write the decisions added since the last flush into their policies' status (newest
        first, at most MAX_DECISIONS), with the mode, the rules, the actions taken and counted;
        whether some wait for a later flush. While another write is under way they all wait
        (no worker queues behind a slow status)."""
        if not self._writing.acquire(blocking=False):
            with self._lock:
                return bool(self._pending)
        try:
            return self._flush()
        finally:
            self._writing.release()

    def _flush(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, {}
            known = self.watch.policies.state.ids()
            for gone in set(self._shown) - known:  # nothing kept of policies gone
                del self._shown[gone]
        for name in known - set(pending):
            policy = self.watch.policy(name)
            shown = policy is not None and self._shown.get(name) == policy.generation
            if policy is not None and policy.observed != policy.generation and not shown:
                pending[name] = []  # new or changed: its mode and rules are shown at once
        waiting = False
        for name, decisions in pending.items():
            policy = self.watch.policy(name)
            if policy is None:
                continue  # gone: nothing to write its decisions into
            status = self._status(name)
            if status is None:
                waiting = self._keep(name, decisions) or waiting
                continue
            fresh = [
                dumped
                for d in reversed(decisions)
                if (dumped := d.model_dump(by_alias=True, mode="json", exclude_defaults=True))
                not in status.decisions
            ]
            now = max((d.decided_at for d in decisions), default=self.clock())
            patch = {
                "observedGeneration": policy.generation,
                "mode": mode_of(policy.spec),
                "rules": rules_of(policy.spec),
                "actionsTaken": status.taken + sum(1 for d in fresh if d.get("done")),
                "decisions": (fresh + status.decisions)[:MAX_DECISIONS],
                "actedAt": [format_time(t) for t in recent(status.acted, now)],
            }
            written = self._write(name, status.version, patch)
            if written is None:  # refused for good: kept back, it would never be written
                log.error(
                    "GpuUsagePolicy %s: %d decisions not recorded in its status",
                    name,
                    len(decisions),
                )
            elif not written:
                waiting = self._keep(name, decisions) or waiting
                if decisions:
                    continue
            self._shown[name] = policy.generation  # its mode and rules alone: not again
        return waiting

    def _keep(self, name: str, decisions: list[Decision]) -> bool:
        """Decisions not written yet wait for the next flush, before those added since."""
        if not decisions:
            return False
        with self._lock:
            self._pending[name] = decisions + self._pending.get(name, [])
        return True

    def _status(self, name: str) -> _Status | None:
        """The policy's status as this replica knows it, read from the apiserver when it does
        not (None while it cannot be read, or the policy is gone)."""
        with self._lock:
            known = self._known.get(name)
        if known is not None:
            return known
        try:
            body = self.custom.get_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, name
            )
        except Exception as exc:
            if not isinstance(translate(exc), NotFound):
                log.warning("GpuUsagePolicy %s: status not read, tried again later: %s", name, exc)
            return None
        found = _read(body)
        if found is None:
            return None
        with self._lock:
            return self._known.setdefault(name, found)

    def _write(self, name: str, version: str, patch: dict[str, Any]) -> bool | None:
        """Merge `patch`, built on the status at `version`, into the policy's status; whether
        it landed (None: refused for good). The apiserver refuses it when the status changed
        since (409). What it leaves is known from the answer; after a failure nothing is (a
        write whose answer was lost may have landed)."""
        body = {"metadata": {"resourceVersion": version}, "status": patch}
        try:
            answer = self.custom.patch_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, name, body
            )
        except Exception as exc:
            with self._lock:
                self._known.pop(name, None)
            error = translate(exc)
            log.warning("GpuUsagePolicy %s: status not written: %s", name, error)
            return None if isinstance(error, Forbidden | NotFound | Invalid) else False
        written = _read(answer)
        with self._lock:
            if written is None:
                self._known.pop(name, None)
            else:
                self._known[name] = written
        return True


def _read(body: Any) -> _Status | None:
    """A policy as the apiserver answered it, as the ledger keeps its status."""
    meta = (body or {}).get("metadata") or {}
    version = meta.get("resourceVersion")
    if not isinstance(version, str) or not version:
        return None
    status = (body or {}).get("status") or {}
    acted = (parse_time(t) for t in status.get("actedAt") or [])
    return _Status(
        version,
        list(status.get("decisions") or []),
        int(status.get("actionsTaken") or 0),
        [t for t in acted if t is not None],
    )
