"""Write the node's GpuNodeUsage: create it once, then patch `spec` only.

* The object is named after the node and owned by the Node (see owner), so it goes when the
  node goes.
* Writes are JSON merge patches of `{"spec": ...}` against the main resource: the status
  subresource is the operator's and is never sent. The agent is the only writer of spec, so
  the last write wins without resourceVersion preconditions.
* 404 on patch → create; 409 on create (someone created it meanwhile) → re-read and patch.
  If the Node was recreated (new uid), the owner reference is corrected.
* How often an unchanged report is refreshed: every `heartbeat` (60 s), or, for an agent that
  renews a Lease, every `lease_refresh` (5 minutes) once the report's status says the operator
  judges the node by that Lease (the Stale condition's reason, read from each write's answer:
  no extra request). An operator of an earlier version, or one that cannot read Leases, judges
  by the report's rewrites with a threshold shorter than five minutes: refreshing rarely would
  make it call a live node stale and its pods Unknown (an upgrade that reaches the agents
  first, a Role without Leases).
* A refresh of an unchanged report sends `observedAt` alone: the stored content
  stays what was published (memory within the threshold of what is observed now), so a steady
  node's refresh is a patch of about 60 bytes and no pod changes; every FULL_EVERY-th refresh
  sends the whole published spec, which undoes anyone else's edit of it.
* Whether to write at all is `change.decide`'s call; this module performs the writes and
  counts them, the skipped ones and the failed ones in the agent's metrics (one count each).
* A body the API refuses for good (413, etcd's "request is too large", 422) is never sent
  again: the refusal is logged once and counted, and the same observation is published
  without its processes, the refusal said in `spec.source.message` and on every device (the
  operator then marks the node's pods Unknown, not ended). The full report is tried again once
  the observation changes.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api import names
from gpuusage.api.models import GpuNodeUsageSpec
from gpuusage.kube.errors import (
    ApiError,
    Conflict,
    Invalid,
    NotFound,
    is_permanent_for_body,
    retried,
)
from gpuusage.kube.rest import RestClient, encode
from gpuusage.retry import Backoff
from gpuusage_nodeagent.change import DEFAULT_SHARE_THRESHOLD, Decision, Fingerprint, decide
from gpuusage_nodeagent.metrics import AgentMetrics
from gpuusage_nodeagent.owner import NodeOwner
from gpuusage_nodeagent.report import AttributedReading, without_processes

log = logging.getLogger(__name__)


WRITE_BACKOFF = Backoff((0.2, 0.5, 1.0), jitter=0.2)
FULL_EVERY = 6
"""Every sixth refresh (30 minutes with the defaults) sends the whole published spec."""


def judged_by_lease(stored: Any) -> bool:
    """Whether a GpuNodeUsage, as the API returned it, is judged fresh by its agent's Lease."""
    status = stored.get("status") if isinstance(stored, dict) else None
    for condition in (status or {}).get("conditions") or []:
        if isinstance(condition, dict) and condition.get("type") == names.CONDITION_STALE:
            return bool(
                condition.get("status") == "False"
                and condition.get("reason") == names.STALE_REASON_LEASE
            )
    return False


def observed_text(spec: GpuNodeUsageSpec) -> str:
    """The spec's observedAt as the API writes it."""
    return str(spec.to_api()["observedAt"])


"""Short: a write that still fails is offered again, newer, on the next cycle."""


class Publisher:
    """Keeps one node's GpuNodeUsage in step with the agent's observations."""

    def __init__(
        self,
        api: RestClient,
        node_name: str,
        *,
        heartbeat: timedelta,
        threshold_mib: int,
        share_threshold: float = DEFAULT_SHARE_THRESHOLD,
        metrics: AgentMetrics,
        backoff: Backoff = WRITE_BACKOFF,
        lease_refresh: timedelta | None = None,
    ) -> None:
        self._api = api
        self._path = f"/apis/{names.GROUP}/{names.VERSION}/{names.PLURAL}"
        self.node_name = node_name
        self.heartbeat = heartbeat
        self.lease_refresh = lease_refresh
        """None: the agent renews no Lease, the report is refreshed every heartbeat."""
        self.judged_by_lease = False
        """Whether the report's status, as the last write answered it, says the operator
        judges this node by its Lease."""
        self.threshold_mib = threshold_mib
        self.share_threshold = share_threshold
        self.backoff = backoff
        self.metrics = metrics
        self._published: GpuNodeUsageSpec | None = None
        self._published_fp: Fingerprint | None = None
        self._published_at: datetime | None = None
        self._owner = NodeOwner(api, node_name, backoff)
        self._owner_checked = False
        self._refreshes = 0
        self._refused: tuple[Fingerprint, str, datetime | None] | None = None
        """The fingerprint of the last observation whose full report was refused for good,
        the refusal, and when, for a refusal that may not last: the full report is tried
        again when the observation changes, and after a refusal by validation (a policy or
        webhook, which an administrator may fix) a refresh later too; a body too large stays
        too large."""
        self.current = False
        """Whether the stored report stands for the latest observation offered: it was
        written, or the write rule found nothing worth writing, or what was refused is itself
        published. The Lease vouches only for such a report (see main.run_cycles)."""

    @property
    def published(self) -> GpuNodeUsageSpec | None:
        return self._published

    @property
    def refresh_every(self) -> timedelta:
        """How long an unchanged report goes without a write."""
        if self.lease_refresh is not None and self.judged_by_lease:
            return self.lease_refresh
        return self.heartbeat

    def offer(self, reading: AttributedReading, force: bool = False) -> Decision:
        """Write the reading's report if the rule says so (its spec is built only then), as of
        the time it was observed. Raises ApiError when the write failed after retries (counted
        here); the caller offers its next reading later, so nothing is lost."""
        new_fp = reading.fingerprint()
        now = reading.observed_at
        decision = decide(
            self._published_fp,
            self._published_at,
            new_fp,
            now,
            heartbeat=self.refresh_every,
            threshold_mib=self.threshold_mib,
            share_threshold=self.share_threshold,
        )
        if force and not decision.write:
            decision = Decision(True, "forced")
        if not decision.write:
            self.metrics.skipped.inc()
            self.current = self._published is not None
            return decision
        self.current = False  # until this write lands
        since = self._refused[2] if self._refused is not None else None
        retry = since is not None and now - since >= self.refresh_every
        if retry:
            self._refused = None  # the full report once more
        if decision.reason == "heartbeat" and not retry and self._refresh(now):
            self.current = True
            return decision
        spec = reading.spec()
        if self._refused is not None and self._refused[0] == new_fp:
            spec = without_processes(spec, self._refused[1])  # never the refused body again
        try:
            self._write_counted(spec)
        except ApiError as exc:
            if not is_permanent_for_body(exc) or (
                self._refused is not None and (self._refused[0] == new_fp)
            ):
                raise  # transient, or even the report without processes was refused
            log.error(
                "the API refused the report of %s for good: %s; publishing it without "
                "processes until the observation changes",
                self.node_name,
                exc,
            )
            self._refused = (new_fp, str(exc), now if isinstance(exc, Invalid) else None)
            spec = without_processes(spec, str(exc))
            self._write_counted(spec)
        if self._refused is not None and self._refused[0] != new_fp:
            self._refused = None  # a new observation went through in full
        self._published, self._published_fp, self._published_at = spec, new_fp, now
        self.current = True
        self.metrics.last_publish.set(now.timestamp())
        log.debug("published %s (%s)", self.node_name, decision.reason)
        return decision

    def _refresh(self, now: datetime) -> bool:
        """An unchanged report (within the threshold) refreshed with the content that was
        published, so the operator has no pod to rewrite for a few MiB of jitter: `observedAt`
        alone, and every FULL_EVERY-th time the whole published spec, which also undoes an
        edit of the spec by anyone else (only the agent may write it, but an administrator
        can). False when it must be written from the reading (nothing published yet, or the
        object is gone)."""
        published = self._published
        if published is None:
            return False
        refreshed = published.model_copy(update={"observed_at": now})
        self._refreshes += 1
        whole = self._refreshes % FULL_EVERY == 0
        body = {"spec": refreshed.to_patch() if whole else {"observedAt": observed_text(refreshed)}}
        try:
            self._patch(body)
        except NotFound:
            return False
        except ApiError as exc:
            self.metrics.api_failures.labels(kind=type(exc).__name__).inc()
            raise
        self._published, self._published_at = refreshed, now
        self.metrics.last_publish.set(now.timestamp())
        return True

    def _write_counted(self, spec: GpuNodeUsageSpec) -> None:
        try:
            self._write(spec)
        except ApiError as exc:
            self.metrics.api_failures.labels(kind=type(exc).__name__).inc()
            raise

    # -- API -------------------------------------------------------------------------------
    def _write(self, spec: GpuNodeUsageSpec) -> None:
        body: dict[str, Any] = {"spec": spec.to_patch()}
        if not self._owner_checked:
            body["metadata"] = {"ownerReferences": [self._owner.reference()]}
        try:
            self._patch(body)
        except NotFound:
            self._create(body)
        self._owner_checked = True

    def _patch(self, body: dict[str, Any]) -> None:
        answer = retried(
            lambda: self._api.merge_patch(f"{self._path}/{self.node_name}", body),
            f"patch {names.KIND} {self.node_name}",
            self.backoff,
        )
        self.metrics.count_write("patch", len(encode(body)))
        self._learn(answer)

    def _learn(self, stored: Any) -> None:
        """What the written object's status says of how the operator judges this node."""
        judged = judged_by_lease(stored)
        if self.lease_refresh is not None and judged != self.judged_by_lease:
            log.info(
                "the operator %s: an unchanged report is refreshed every %.0fs",
                "judges this node by its Lease"
                if judged
                else "does not judge this node by its Lease (yet)",
                (self.lease_refresh if judged else self.heartbeat).total_seconds(),
            )
        self.judged_by_lease = judged

    def _create(self, body: dict[str, Any]) -> None:
        full = {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "metadata": {"name": self.node_name, "ownerReferences": [self._owner.reference()]},
            "spec": body["spec"],
        }
        try:
            retried(
                lambda: self._api.post(self._path, full),
                f"create {names.KIND} {self.node_name}",
                self.backoff,
            )
        except Conflict:
            # Created meanwhile (another agent start, a restore): patch what is there.
            self._patch(
                {**body, "metadata": {"ownerReferences": full["metadata"]["ownerReferences"]}}
            )
            return
        self.metrics.count_write("create", len(encode(full)))
