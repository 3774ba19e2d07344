"""Each GpuUsagePolicy's status as the leader keeps it: the decisions to record, the enforced
actions the rate limits count, and the writes that keep the status true through faults and
handovers.

Only the leader writes a policy's status, and it keeps what it last read or wrote of it (read
once after a start or a takeover, then its own writes). Every write names that
resourceVersion, so a write built on a status changed meanwhile (the spec edited; another
replica, while this one lost the lead and won it back within one reconcile) is refused (409),
the status read back and the write made again. A fault leaves the status behind, never wrong:

* Decisions whose write failed wait for a flush at least STATUS_RETRY later (a reconcile's or
  the housekeeping pass's), and the status is read back first: a decision that a write whose
  answer was lost had recorded is neither listed nor counted twice. While they wait, every
  done one is kept, and of the others the newest the status can list. A status the apiserver
  refuses for good (no right to it, the policy gone, a body refused) keeps nothing back: the
  decisions are logged and dropped.
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
from typing import Any, Literal

from gpuusage.api import names
from gpuusage.api.policy import MAX_DECISIONS, Decision, GpuUsagePolicySpec
from gpuusage.api.times import format_time, parse_time
from gpuusage.kube.errors import Conflict, Forbidden, Invalid, NotFound, translate
from gpuusage_operator.informers.policywatch import PolicyWatch
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


Written = Literal["Written", "Conflict", "Failed", "Refused"]
"""What became of a status write: landed; refused as built on an older version (409); failed
for now (it may have landed all the same); refused for good (no right, the policy gone, the
body refused)."""


class _Refused:
    """A status the apiserver refuses to read for good (no right to it, the policy gone)."""


REFUSED = _Refused()


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
    _term: int = 0
    """Bumped by forget: a reservation that saw it change did not know every count."""
    _retry_at: datetime | None = None
    """No flush before then: the last one could not write everything (see flush)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the fields above (never held across a request)."""
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
            self._term += 1

    def acted(self, now: datetime) -> dict[str, list[datetime]] | None:
        """Each policy's counted actions of the last hour (a policy gone counts for the
        cluster's limit while its times do); None while one's status cannot be read."""
        existing = self.watch.policies.state.ids()
        with self._lock:
            for gone in [n for n in self._known if n not in existing]:
                if not recent(self._known[gone].acted, now):
                    del self._known[gone]
            names_ = set(self._known) | existing
        counted: dict[str, list[datetime]] = {}
        for name in names_:
            status = self._status(name)
            if isinstance(status, _Refused):
                continue  # gone meanwhile (or never readable): nothing of it to count
            if status is None:
                return None
            counted[name] = recent(status.acted, now)
        return counted

    def reserve(self, policy: str) -> Slot:
        """Count one of the policy's enforced actions, about to be taken now, in its status;
        the slot says whether to take it (see the module's docstring). Built on a status
        changed meanwhile (the spec edited, another leader), the count is read back and
        decided again once."""
        with self._writing:
            for _ in range(2):
                slot = self._reserve(policy)
                if isinstance(slot, Slot):
                    return slot
            return Slot(retry=self.clock().replace(microsecond=0) + STATUS_RETRY)

    def _reserve(self, policy: str) -> Slot | Literal["Conflict"]:
        now = self.clock().replace(microsecond=0)
        with self._lock:
            term = self._term
        found = self.watch.policy(policy)
        if found is None:
            return Slot(retry=now + GONE_RETRY)
        status = self._status(policy)  # what the write is built on, and its version
        counted = self.acted(now)
        if not isinstance(status, _Status) or counted is None:
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
        written = self._write(policy, status.version, {"actedAt": acted})
        if written == "Conflict":
            return written
        if written != "Written":
            return Slot(retry=now + STATUS_RETRY)  # not counted: not taken
        with self._lock:
            if self._term != term:  # the other policies' counts were of another term
                return Slot(retry=now + STATUS_RETRY)  # counted all the same: errs to fewer
        return Slot(at=now)

    def release(self, policy: str, at: datetime) -> None:
        """The action counted at `at` was not taken (refused, gone, not applicable): the next
        write of the status drops it."""
        with self._writing, self._lock:
            status = self._known.get(policy)
            if status is not None and at in status.acted:
                status.acted.remove(at)

    def flush(self) -> None:
        """Write the decisions added since the last flush into their policies' status (newest
        first, at most MAX_DECISIONS), with the mode, the rules, the actions taken and counted.
        What could not be written waits: after a failure no flush tries before STATUS_RETRY
        has passed (a status that cannot be written is not asked at every reconcile), and the
        housekeeping pass flushes too, so what waits is written though no reconcile comes.
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
            waiting = self._flush()
        finally:
            self._writing.release()
        with self._lock:
            self._retry_at = now + STATUS_RETRY if waiting else None

    def waiting(self) -> bool:
        """Whether decisions (or a policy's mode and rules) wait to be written."""
        with self._lock:
            return bool(self._pending)

    def _flush(self) -> bool:
        """Flush, under `_writing`; whether something waits."""
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
            written: Written = "Conflict"
            try:
                for _ in range(2):  # built on a status changed meanwhile: read back, once
                    written = self._record(name, policy.generation, policy.spec, decisions)
                    if written != "Conflict":
                        break
            except Exception:  # kept for the next flush: nothing taken out is lost
                log.exception("GpuUsagePolicy %s: status not written", name)
                written = "Failed"
            if written == "Refused":  # it would never be written: kept back
                log.error(
                    "GpuUsagePolicy %s: %d decisions not recorded in its status",
                    name,
                    len(decisions),
                )
            elif written != "Written":
                self._keep(name, decisions, shown=policy.generation)
                waiting = True
                continue
            with self._lock:
                self._shown[name] = policy.generation
        return waiting

    def _record(
        self, name: str, generation: int, spec: GpuUsagePolicySpec, decisions: list[Decision]
    ) -> Written:
        """One write of the decisions, the mode and the rules into the policy's status."""
        status = self._status(name)
        if isinstance(status, _Refused):
            return "Refused"
        if status is None:
            return "Failed"
        fresh = [
            dumped
            for d in reversed(decisions)
            if (dumped := d.model_dump(by_alias=True, mode="json", exclude_defaults=True))
            not in status.decisions
        ]
        now = max((d.decided_at for d in decisions), default=self.clock())
        patch = {
            "observedGeneration": generation,
            "mode": mode_of(spec),
            "rules": rules_of(spec),
            "actionsTaken": status.taken + sum(1 for d in fresh if d.get("done")),
            "decisions": (fresh + status.decisions)[:MAX_DECISIONS],
            "actedAt": [format_time(t) for t in recent(status.acted, now)],
        }
        return self._write(name, status.version, patch)

    def _keep(self, name: str, decisions: list[Decision], *, shown: int) -> None:
        """Decisions not written yet wait for the next flush, before those added since. Every
        done one is kept (actionsTaken counts it; the rate limits bound the enforced ones,
        the pods the notices);
        of the others only the newest, up to what the status lists. A policy whose mode and
        rules alone were not written waits too."""
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
            if self._shown.get(name) == shown:
                del self._shown[name]

    def _status(self, name: str) -> _Status | _Refused | None:
        """The policy's status as this replica knows it, read from the apiserver when it does
        not (REFUSED for good, None while it cannot be read)."""
        with self._lock:
            known, term = self._known.get(name), self._term
        if known is not None:
            return known
        try:
            body = self.custom.get_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, name
            )
        except Exception as exc:
            error = translate(exc)
            if isinstance(error, NotFound):
                return REFUSED
            log.warning("GpuUsagePolicy %s: status not read: %s", name, error)
            return REFUSED if isinstance(error, Forbidden) else None
        found = _read(body)
        if found is None:
            return None
        with self._lock:
            if self._term != term:  # read in the term before: not kept, not used
                return None
            return self._known.setdefault(name, found)

    def _write(self, name: str, version: str, patch: dict[str, Any]) -> Written:
        """Merge `patch`, built on the status at `version`, into the policy's status. The
        apiserver refuses it when the status changed since (409). What it leaves is known from
        the answer; after a failure nothing is (a write whose answer was lost may have
        landed)."""
        body = {"metadata": {"resourceVersion": version}, "status": patch}
        try:
            answer = self.custom.patch_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, name, body
            )
        except Exception as exc:
            with self._lock:
                self._known.pop(name, None)
            error = translate(exc)
            if isinstance(error, Conflict):
                return "Conflict"
            log.warning("GpuUsagePolicy %s: status not written: %s", name, error)
            return "Refused" if isinstance(error, Forbidden | NotFound | Invalid) else "Failed"
        written = _read(answer)
        with self._lock:
            if written is None:
                self._known.pop(name, None)
            else:
                self._known[name] = written
        return "Written"


def _read(body: Any) -> _Status | None:
    """A policy as the apiserver answered it, as the ledger keeps its status."""
    meta = (body or {}).get("metadata") or {}
    version = meta.get("resourceVersion")
    if not isinstance(version, str) or not version:
        return None
    status = (body or {}).get("status") or {}
    acted = (parse_time(t) for t in status.get("actedAt") or [])
    taken, decisions = status.get("actionsTaken"), status.get("decisions")
    return _Status(
        version,
        [d for d in decisions if isinstance(d, dict)] if isinstance(decisions, list) else [],
        taken if isinstance(taken, int) else 0,
        [t for t in acted if t is not None],
    )
