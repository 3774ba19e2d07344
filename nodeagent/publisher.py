"""Write the node's GpuNodeUsage: create it once, then patch `spec` only.

* The object is named after the node and owned by the Node (apiVersion v1, kind Node, name,
  uid; no blockOwnerDeletion), so it goes when the node goes.
* Writes are JSON merge patches of `{"spec": ...}` against the main resource: the status
  subresource is the operator's and is never sent. The agent is the only writer of spec, so
  the last write wins without resourceVersion preconditions.
* 404 on patch → create; 409 on create (someone created it meanwhile) → re-read and patch.
  If the Node was recreated (new uid), the owner reference is corrected.
* Whether to write at all is `change.decide`'s call; this module only performs writes and
  counts them.
* A body the API refuses for good (413, etcd's "request is too large", 422) is never sent
  again: the refusal is logged once and counted, and the same observation is published
  without its processes, the refusal said in `spec.source.message` and on every device (the
  operator then marks the node's pods Unknown, not ended). The full report is tried again once
  the observation changes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api import names
from gpuusage.api.models import GpuNodeUsageSpec
from gpuusage.kube.errors import ApiError, Conflict, NotFound, call, is_permanent_for_body
from gpuusage.kube.rest import RestClient
from gpuusage.nodeagent.change import Decision, Fingerprint, decide, fingerprint
from gpuusage.nodeagent.report import Observation, without_processes

log = logging.getLogger(__name__)


SELF_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
NODE_NAME_CLAIM = "authentication.kubernetes.io/node-name"
NODE_UID_CLAIM = "authentication.kubernetes.io/node-uid"


@dataclass
class PublishStats:
    """What the publisher did; read by metrics and tests."""

    writes: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    on_write: Callable[[str, int], None] = lambda verb, size: None

    def count_write(self, verb: str, size: int) -> None:
        self.writes[verb] = self.writes.get(verb, 0) + 1
        self.bytes_written += size
        self.on_write(verb, size)

    def count_failure(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


class Publisher:
    """Keeps one node's GpuNodeUsage in step with the agent's observations."""

    def __init__(
        self,
        api: RestClient,
        node_name: str,
        *,
        heartbeat: timedelta,
        threshold_mib: int,
        backoff: tuple[float, ...] = (0.2, 0.5, 1.0),
        on_write: Callable[[str, int], None] = lambda verb, size: None,
    ) -> None:
        self._api = api
        self._path = f"/apis/{names.GROUP}/{names.VERSION}/{names.PLURAL}"
        self.node_name = node_name
        self.heartbeat = heartbeat
        self.threshold_mib = threshold_mib
        self.backoff = backoff
        self.stats = PublishStats(on_write=on_write)
        self._published: GpuNodeUsageSpec | None = None
        self._published_fp: Fingerprint | None = None
        self._published_at: datetime | None = None
        self._owner_checked = False
        self._node_uid: str | None = None
        self._refused: tuple[Fingerprint, str] | None = None
        """The fingerprint of the last observation whose full report was refused for good,
        and the refusal."""

    @property
    def published(self) -> GpuNodeUsageSpec | None:
        return self._published

    def offer(
        self, observed: GpuNodeUsageSpec | Observation, now: datetime, force: bool = False
    ) -> Decision:
        """Write the observation if the rule says so (an Observation's spec is built only
        then). Raises ApiError when the write failed after retries; the caller offers its
        next observation later, so nothing is lost."""
        if isinstance(observed, Observation):
            new_fp = observed.fingerprint()
        else:
            new_fp = fingerprint(observed)
        decision = decide(
            self._published_fp,
            self._published_at,
            new_fp,
            now,
            heartbeat=self.heartbeat,
            threshold_mib=self.threshold_mib,
        )
        if force and not decision.write:
            decision = Decision(True, "forced")
        if not decision.write:
            self.stats.skipped += 1
            return decision
        spec = observed.spec() if isinstance(observed, Observation) else observed
        if self._refused is not None and self._refused[0] == new_fp:
            spec = without_processes(spec, self._refused[1])  # never the refused body again
        try:
            self._write(spec)
        except ApiError as exc:
            self.stats.count_failure(type(exc).__name__)
            if not is_permanent_for_body(exc) or (
                self._refused is not None and (self._refused[0] == new_fp)
            ):
                raise  # transient, or even the report without processes was refused
            log.error("the API refused the report of %s for good: %s; publishing it without "
                      "processes until the observation changes", self.node_name, exc)  # fmt: skip
            self._refused = (new_fp, str(exc))
            spec = without_processes(spec, str(exc))
            self._write(spec)
        if self._refused is not None and self._refused[0] != new_fp:
            self._refused = None  # a new observation went through in full
        self._published, self._published_fp, self._published_at = spec, new_fp, now
        log.debug("published %s (%s)", self.node_name, decision.reason)
        return decision

    # -- API -------------------------------------------------------------------------------
    def _owner(self) -> dict[str, Any]:
        uid = self._node_uid_from_token() or self._node_uid_from_node()
        self._node_uid = uid
        return {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid}

    def _node_uid_from_token(self) -> str | None:
        """The Node's UID as the apiserver put it in our pod-bound token (SelfSubjectReview).

        In a cluster the agent's token is bound to its pod, and since Kubernetes 1.32 the
        apiserver records the pod's node name and UID in it; asking "who am I" needs no
        permission, so the agent needs none on Nodes at all. Elsewhere (a kubeconfig) the
        answer has no node and the Node is read instead.
        """
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        try:
            answer = call(lambda: self._api.post(SELF_REVIEW, review), "who am I", self.backoff)
        except ApiError as exc:
            log.debug("SelfSubjectReview unavailable (%s); reading the Node", exc)
            return None
        extra = ((answer.get("status") or {}).get("userInfo") or {}).get("extra") or {}
        names_ = extra.get(NODE_NAME_CLAIM) or []
        uids = extra.get(NODE_UID_CLAIM) or []
        if names_ == [self.node_name] and len(uids) == 1 and uids[0]:
            return str(uids[0])
        return None

    def _node_uid_from_node(self) -> str:
        node = call(lambda: self._api.get(f"/api/v1/nodes/{self.node_name}"), "read node",
                    self.backoff)  # fmt: skip
        uid = (node.get("metadata") or {}).get("uid")
        if not uid:
            raise NotFound(f"node {self.node_name} has no uid", 404)
        return str(uid)

    def _write(self, spec: GpuNodeUsageSpec) -> None:
        body: dict[str, Any] = {"spec": spec.to_api()}
        if not self._owner_checked:
            body["metadata"] = {"ownerReferences": [self._owner()]}
        try:
            self._patch(body)
        except NotFound:
            self._create(body)
        self._owner_checked = True

    def _patch(self, body: dict[str, Any]) -> None:
        call(
            lambda: self._api.merge_patch(f"{self._path}/{self.node_name}", body),
            f"patch {names.KIND} {self.node_name}",
            self.backoff,
        )
        self.stats.count_write("patch", len(json.dumps(body)))

    def _create(self, body: dict[str, Any]) -> None:
        full = {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "metadata": {"name": self.node_name, "ownerReferences": [self._owner()]},
            "spec": body["spec"],
        }
        try:
            call(
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
        self.stats.count_write("create", len(json.dumps(full)))
