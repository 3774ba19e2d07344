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
from typing import Any, Literal

from gpuusage.api import names
from gpuusage.api.policy import MAX_DECISIONS, Decision, GpuUsagePolicySpec
from gpuusage.api.times import format_time, parse_time
from gpuusage.kube.errors import Conflict, Forbidden, Invalid, NotFound, translate
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
    _unlisted: dict[str, int] = field(default_factory=dict)
    """Done decisions dropped from the pending ones past MAX_DECISIONS: still counted."""
    _known: dict[str, _Status] = field(default_factory=dict)
    _shown: dict[str, int] = field(default_factory=dict)
    """The generation whose mode and rules this replica last wrote, by policy."""
    _term: int = 0
    """Bumped by forget: a reservation that saw it change did not know every count."""
    _retry_at: datetime | None = None
    """When a reconcile is due to flush what waits (one for all of them: see flush)."""
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

    def flush(self) -> bool:
        """Write the decisions added since the last flush into their policies' status (newest
        first, at most MAX_DECISIONS), with the mode, the rules, the actions taken and counted;
        whether the calling reconcile is to run again STATUS_RETRY later to flush what waits.
        After a failure one reconcile is, and until then the others leave what they add to it
        (a status that cannot be written is tried once every STATUS_RETRY, not by every
        reconcile); while another write is under way, what is added waits the same way (no
        worker queues behind a slow status)."""
        with self._lock:
            if self._retry_at is not None and self.clock() < self._retry_at:
                return False  # what waits is written by the reconcile due then
        if not self._writing.acquire(blocking=False):
            return self._again()
        try:
            with self._lock:
                self._retry_at = None
            self._flush()
        finally:
            self._writing.release()
        return self._again()

    def _again(self) -> bool:
        """Whether the caller is the one to flush again later: something waits, and no other
        reconcile is due to."""
        now = self.clock()
        with self._lock:
            if not self._pending or (self._retry_at is not None and self._retry_at > now):
                return False
            self._retry_at = now + STATUS_RETRY
            return True

    def _flush(self) -> None:
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
        for name, decisions in pending.items():
            policy = self.watch.policy(name)
            if policy is None:
                continue  # gone: nothing to write its decisions into
            written: Written = "Conflict"
            for _ in range(2):  # built on a status changed meanwhile: read back, once
                written = self._record(name, policy.generation, policy.spec, decisions)
                if written != "Conflict":
                    break
            if written == "Refused":  # it would never be written: kept back
                log.error(
                    "GpuUsagePolicy %s: %d decisions not recorded in its status",
                    name,
                    len(decisions),
                )
            elif written != "Written":
                self._keep(name, decisions, shown=policy.generation)
                continue
            with self._lock:
                self._shown[name] = policy.generation
                if written == "Written":
                    self._unlisted.pop(name, None)

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
        with self._lock:
            unlisted = self._unlisted.get(name, 0)
        now = max((d.decided_at for d in decisions), default=self.clock())
        patch = {
            "observedGeneration": generation,
            "mode": mode_of(spec),
            "rules": rules_of(spec),
            "actionsTaken": status.taken + unlisted + sum(1 for d in fresh if d.get("done")),
            "decisions": (fresh + status.decisions)[:MAX_DECISIONS],
            "actedAt": [format_time(t) for t in recent(status.acted, now)],
        }
        return self._write(name, status.version, patch)

    def _keep(self, name: str, decisions: list[Decision], *, shown: int) -> None:
        """Decisions not written yet wait for the next flush, before those added since; past
        MAX_DECISIONS the oldest are dropped (the status lists no more), their done ones still
        counted. A policy whose mode and rules alone were not written waits too."""
        with self._lock:
            waiting = decisions + self._pending.get(name, [])
            dropped = waiting[:-MAX_DECISIONS]
            if dropped:
                self._unlisted[name] = self._unlisted.get(name, 0) + sum(d.done for d in dropped)
                log.warning(
                    "GpuUsagePolicy %s: %d decisions dropped while its status cannot be written",
                    name,
                    len(dropped),
                )
            self._pending[name] = waiting[-MAX_DECISIONS:]
            if self._shown.get(name) == shown:
                del self._shown[name]

    def _status(self, name: str) -> _Status | _Refused | None:
        """The policy's status as this replica knows it, read from the apiserver when it does
        not (REFUSED for good, None while it cannot be read)."""
        with self._lock:
            known = self._known.get(name)
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
    return _Status(
        version,
        list(status.get("decisions") or []),
        int(status.get("actionsTaken") or 0),
        [t for t in acted if t is not None],
    )
