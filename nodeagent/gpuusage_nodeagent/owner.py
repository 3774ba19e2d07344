"""The agent's Node, as the owner of what the agent writes (its report and its Lease).

Both are owned by the Node (apiVersion v1, kind Node, name, uid; no blockOwnerDeletion), so they
go when the node goes. The UID comes from the agent's own pod-bound token when it can
(SelfSubjectReview: asking "who am I" needs no permission, so the agent needs none on Nodes),
else from the Node (a kubeconfig outside a pod).
"""

from __future__ import annotations

import logging
from typing import Any

from gpuusage.kube.errors import ApiError, NotFound, retried
from gpuusage.kube.rest import RestClient
from gpuusage.retry import Backoff

log = logging.getLogger(__name__)

SELF_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
NODE_NAME_CLAIM = "authentication.kubernetes.io/node-name"
NODE_UID_CLAIM = "authentication.kubernetes.io/node-uid"


class NodeOwner:
    """Finds the Node's UID once per call of `reference` (a write that found the object
    missing asks again: the Node may have been recreated)."""

    def __init__(self, api: RestClient, node_name: str, backoff: Backoff) -> None:
        self._api = api
        self.node_name = node_name
        self.backoff = backoff

    def reference(self) -> dict[str, Any]:
        uid = self._from_token() or self._from_node()
        return {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid}

    def _from_token(self) -> str | None:
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        try:
            answer = retried(lambda: self._api.post(SELF_REVIEW, review), "who am I", self.backoff)
        except ApiError as exc:
            log.debug("SelfSubjectReview unavailable (%s); reading the Node", exc)
            return None
        extra = ((answer.get("status") or {}).get("userInfo") or {}).get("extra") or {}
        node_names = extra.get(NODE_NAME_CLAIM) or []
        uids = extra.get(NODE_UID_CLAIM) or []
        if node_names == [self.node_name] and len(uids) == 1 and uids[0]:
            return str(uids[0])
        return None

    def _from_node(self) -> str:
        path = f"/api/v1/nodes/{self.node_name}"
        node = retried(lambda: self._api.get(path), "read node", self.backoff)
        uid = (node.get("metadata") or {}).get("uid")
        if not uid:
            raise NotFound(f"node {self.node_name} has no uid", 404)
        return str(uid)
