"""The agent's heartbeat: a `coordination.k8s.io/v1` Lease named after its node (60 s duration,
renewed every 20 s: half as often as the kubelet renews its node Lease, so that the agents add
half, not as much again, to the control plane's heartbeat writes).

Liveness costs the control plane a small merge patch of `spec.renewTime` instead of a rewrite of
the whole report, so the report itself is written only when it changed or after a long refresh
(see Publisher). The operator judges a node fresh by when *it* saw the renewals change, by its
own clock, never by the time written.

The Lease is renewed only after a cycle that read the node completed: an agent stuck in a driver
call or failing every cycle stops renewing, and its report turns stale, as it should. It lives
in the agent's own namespace and is owned by the Node (see owner); the admission policy keeps
each agent to its own node's Lease.
"""

from __future__ import annotations

import logging
import socket
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api import names
from gpuusage.api.times import format_micro_time
from gpuusage.kube.errors import ApiError, Conflict, NotFound, retried
from gpuusage.kube.rest import RestClient, encode
from gpuusage.retry import Backoff
from gpuusage_nodeagent.metrics import AgentMetrics
from gpuusage_nodeagent.owner import NodeOwner

log = logging.getLogger(__name__)

LEASE_DURATION = timedelta(seconds=60)


def holder_identity() -> str:
    """The agent's identity in the Lease: its pod's name (the hostname in a pod)."""
    return names.LEASE_HOLDER_PREFIX + socket.gethostname()


def renew_every(duration: timedelta) -> timedelta:
    """A third of the duration: two renewals may fail before it ends (the kubelet renews every
    quarter, three; a renewal here waits for a cycle that read the node, at most --interval
    late, which the duration's last third covers)."""
    return duration / 3


class LeaseRenewer:
    """Renews one Lease; `renew_if_due` is called by the loop after each completed cycle."""

    def __init__(
        self,
        api: RestClient,
        namespace: str,
        node_name: str,
        *,
        metrics: AgentMetrics,
        backoff: Backoff,
        duration: timedelta = LEASE_DURATION,
        holder: str | None = None,
    ) -> None:
        self._api = api
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.namespace, self.node_name = namespace, node_name
        self.duration = duration
        self.holder = holder or holder_identity()
        self.metrics = metrics
        self.backoff = backoff
        self._owner = NodeOwner(api, node_name, backoff)
        self._renewed_at: datetime | None = None

    def due(self, now: datetime) -> bool:
        """Whether a renewal is due; a tenth of the period early, so that a cycle finishing a
        moment before the mark does not push the renewal a whole cycle later."""
        if self._renewed_at is None:
            return True
        return now - self._renewed_at >= renew_every(self.duration) * 0.9

    def renew_if_due(self, now: datetime) -> bool:
        """Renew when due; True when a renewal was written. Raises ApiError (counted) when the
        API refused or could not be reached after retries: the next cycle tries again."""
        if not self.due(now):
            return False
        spec = {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": int(self.duration.total_seconds()),
            "renewTime": format_micro_time(now),
        }
        try:
            self._renew(spec, now)
        except ApiError as exc:
            self.metrics.api_failures.labels(kind=type(exc).__name__).inc()
            raise
        self._renewed_at = now
        return True

    def _renew(self, spec: dict[str, Any], now: datetime) -> None:
        body = {"spec": spec}
        try:
            self._patch(body)
            return
        except NotFound:
            pass
        full = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.node_name,
                "namespace": self.namespace,
                "ownerReferences": [self._owner.reference()],
            },
            "spec": {**spec, "acquireTime": format_micro_time(now)},
        }
        try:
            retried(lambda: self._api.post(self.path, full), "create lease", self.backoff)
        except Conflict:  # created meanwhile (a restart racing its predecessor): renew it
            self._patch(body)
            return
        log.info("created Lease %s/%s", self.namespace, self.node_name)
        self.metrics.count_write("lease-create", len(encode(full)))

    def _patch(self, body: dict[str, Any]) -> None:
        target = f"{self.path}/{self.node_name}"
        retried(lambda: self._api.merge_patch(target, body), "renew lease", self.backoff)
        self.metrics.count_write("lease", len(encode(body)))
