"""The operator's settings: every flag, its environment variable, default and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from gpuusage.api import names
from gpuusage.api.policy import MAX_ACTIONS_PER_HOUR
from gpuusage.kube.config import REQUEST_TIMEOUT
from gpuusage.settings import CommandSettings, comma_list
from gpuusage_operator.ha.peering import MAX_PRIORITY
from gpuusage_operator.informers.informer import WATCH_IDLE
from gpuusage_operator.judge.requests import AllocationRules
from gpuusage_operator.judge.resolution import DEFAULT_DRIVER_NAMESPACES
from gpuusage_operator.policies.limit import CLUSTER_ACTIONS_PER_HOUR
from gpuusage_operator.writers.budget import DEFAULT_WRITE_BURST, DEFAULT_WRITE_RATE


class OperatorSettings(CommandSettings):
    kubeconfig: Path | None = None
    """Kubeconfig file; else $KUBECONFIG, the in-cluster service account, ~/.kube/config."""
    stale_after: float | None = Field(default=None, gt=0)
    """Seconds without a sign of life from a node's agent (a renewal of its Lease, or a change
    of its report) after which its report is stale, by the operator's clock. Unset: the
    agent's Lease's own duration (leaseDurationSeconds, the agent's --lease-duration), as the
    kubelet's Lease holds it alive, or 180 for an agent that renews no Lease."""
    idle_after: float = Field(default=1800.0, ge=0)
    """Seconds a running pod may leave the GPUs it requested unused before it is flagged
    (status.idlePods, pod condition reason RequestedGPUsIdle, a Warning Event); 0: never. Judged
    at each report, so within one agent heartbeat of the threshold."""
    restart_grace: float = Field(default=60.0, ge=0, le=3600)
    """Seconds after a container's exit that its pod's GPU use, missing meanwhile, is Unknown
    (reason ContainerRestarted) rather than ended, while the kubelet restarts the container;
    use seen again within them went on (no Event). 0: a restart ends use at once."""
    policy_notice: float = Field(default=300.0, ge=0, le=86400)
    """Seconds a policy's announcement (the pod's gpuusage.io/policy-action annotation and a
    Warning Event) comes at least before its deadline, so that the pod's owner can react."""
    policy_actions: bool = False
    """Carry out enforced policy actions other than Notify (ScaleToZero, Suspend, DeletePod,
    Evict); the rights they need come with the install's policy-actions part. Off: such
    decisions are recorded as NotPermitted."""
    policy_cluster_actions_per_hour: int = Field(
        default=CLUSTER_ACTIONS_PER_HOUR, ge=1, le=MAX_ACTIONS_PER_HOUR
    )
    """Enforced policy actions that change something (all but Notify) that all policies
    together take in any sliding hour; each policy has its own maxActionsPerHour too."""
    resync: float = Field(default=10.0, gt=0)
    """Seconds between housekeeping passes: an API probe, marks of nodes without a report, and
    the OpenReports brought in line with the findings."""
    openreports: bool = True
    """Publish the findings as OpenReports (openreports.io/v1alpha1): a Report per namespace
    for its pods, the ClusterReport gpuusage-nodes for the nodes, where Policy Reporter reads
    them. Where that API is not served, nothing is written and the log says so once."""
    pod_writes_per_second: float = Field(default=DEFAULT_WRITE_RATE, gt=0, le=10000)
    """Pod writes (annotations, condition) a second across the cluster once the burst is
    spent; over it, a pod's writes wait for the next reconcile of its report."""
    pod_write_burst: int = Field(default=DEFAULT_WRITE_BURST, ge=2, le=100000)
    """Pod writes allowed at once before the rate applies (at least the two of one pod)."""
    api_timeout: float = Field(default=REQUEST_TIMEOUT, ge=1, le=600)
    """Seconds any API request may wait for the next bytes of its answer before it fails (a
    client-side read timeout; connecting has 10 s): no call hangs on a dead connection."""
    watch_idle_timeout: float = Field(default=WATCH_IDLE, ge=1, le=3600)
    """Seconds a watch of pods, Leases, DRA objects or policies may receive nothing, not even
    a bookmark, before its connection is taken for dead and its objects listed again (a
    half-open connection: a peer gone without closing it, a dropped NAT entry)."""
    standalone: bool = False
    """Run without peering (one replica only, e.g. on a workstation). Otherwise replicas share
    the ClusterKopfPeering named by --peering and exactly one of them is active."""
    peering: Annotated[str, Field(min_length=1, max_length=253)] = names.DEFAULT_PEERING
    """Name of the ClusterKopfPeering object the replicas share (created when missing)."""
    priority: Annotated[int, Field(ge=0, le=MAX_PRIORITY)] | None = None
    """Peering priority: the live replica with the highest one is active. Default: random at
    start, so that replicas never tie (equal priorities would pause all of them)."""
    peering_lifetime: int = Field(default=30, ge=10, le=3600)
    """Seconds a replica's peering record stays valid without renewal: how long a crashed
    active replica blocks the standby (a clean shutdown hands over at once)."""
    health_port: int = Field(default=0, ge=0, le=65535)
    """Port of kopf's liveness endpoint (GET /healthz, for a liveness probe); 0: none."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of the Prometheus endpoint (/metrics); 0: none (the manifests use 9748)."""
    metrics_address: str = "0.0.0.0"
    """Address the Prometheus endpoint listens on."""
    workers: int = Field(default=16, ge=1, le=256)
    """Reconciles run at once (each mostly waits for the apiserver)."""
    gpu_resources: str = ""
    """Extra extended-resource names that count as GPU requests besides nvidia.com/gpu and
    nvidia.com/mig-*, comma-separated (e.g. a vendor's variant, HAMi's resource name)."""
    fraction_annotations: str = "gpu-fraction,gpu-memory"
    """Pod annotations by which a fractional scheduler (KAI, Run:ai) gives a GPU share,
    comma-separated: a pod carrying one has a GPU allocation."""
    dra_drivers: str = "gpu.nvidia.com"
    """DRA drivers whose allocated devices are GPUs, comma-separated."""
    driver_namespaces: str = ",".join(DEFAULT_DRIVER_NAMESPACES)
    """Namespaces where the cluster's GPU components run (NVIDIA's GPU Operator, device plugin,
    DRA driver), comma-separated: NVIDIA's MPS server in a pod there is a driver process, not a
    tenant using a GPU it did not request."""
    lease_namespace: str = Field(
        default="", max_length=63, json_schema_extra={"env": ["POD_NAMESPACE"]}
    )
    """Namespace of the node agents' Leases (installed together: the operator's own,
    POD_NAMESPACE from the downward API). Empty: liveness from the reports' rewrites alone."""

    def driver_namespace_set(self) -> frozenset[str]:
        return frozenset(comma_list(self.driver_namespaces))

    def allocation_rules(self) -> AllocationRules:
        """The three lists above, as the allocation rules take them."""
        return AllocationRules(
            extra_resources=comma_list(self.gpu_resources),
            fraction_annotations=comma_list(self.fraction_annotations),
            dra_drivers=comma_list(self.dra_drivers),
        )
