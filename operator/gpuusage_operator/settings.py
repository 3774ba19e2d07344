"""The operator's settings: every flag, its environment variable, default and reason."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from gpuusage.api import names
from gpuusage.api.policy import MAX_ACTIONS_PER_HOUR
from gpuusage.api.selectors import parse_selector
from gpuusage.kube.config import REQUEST_TIMEOUT
from gpuusage.settings import CommandSettings, comma_list, flag_name
from gpuusage_operator.controller.scope import Scope
from gpuusage_operator.ha.election import LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD, Timing
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
    pod_marks: bool = True
    """Write gpuusage's marks on pods: the gpuusage.io/ annotations, the GPUInUse condition,
    the Events about pods, the policies' announcements and actions on pods. Off (observe
    first): nothing is written on any pod, the reports' status, the OpenReports and the
    metrics carry everything, and marks an earlier start wrote are taken off where the
    install may still write pods."""
    namespace_selector: str = ""
    """A label selector on namespaces (kubectl's -l form: team=research,env in (prod,dev)):
    pod marks, pod Events and policies only in namespaces whose labels match; the reports still
    count every pod and mark those outside (outOfScope). Empty: every namespace."""
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
    allow_old_kubernetes: bool = False
    """Run on a cluster older than the oldest supported Kubernetes (gpuusage.kube.serverversion:
    1.35), where nothing proves how its allocations are judged; otherwise such a cluster is
    refused at start with the floor and the reason."""
    standalone: bool = False
    """Act alone, with no leader election (one replica only, e.g. on a workstation).
    Otherwise the replicas elect a leader through a Lease and only the leader acts."""
    leader_elect_lease_duration: int = Field(default=int(LEASE_DURATION), ge=2, le=3600)
    """Seconds a standby waits, from when it saw the leader's Lease last change, before it
    may take the Lease over (client-go's --leader-elect-lease-duration): how long a crashed
    leader leaves nobody acting. A clean stop hands over at once."""
    leader_elect_renew_deadline: float = Field(default=RENEW_DEADLINE, gt=0, le=3600)
    """Seconds the leader keeps acting without a successful renewal of its Lease; shorter
    than the lease duration, so it stops before another replica may take over."""
    leader_elect_retry_period: float = Field(default=RETRY_PERIOD, gt=0, le=3600)
    """Seconds between tries to take or renew the Lease; shorter than the renew deadline."""
    leader_elect_resource_name: Annotated[str, Field(min_length=1, max_length=253)] = (
        names.LEADER_LEASE
    )
    """Name of the Lease the replicas elect their leader through (the install's Role lets the
    operator get and update only gpuusage-operator: another name needs its own rule)."""
    leader_elect_resource_namespace: str = Field(
        default="", max_length=63, json_schema_extra={"env": ["POD_NAMESPACE"]}
    )
    """Namespace of that Lease (the operator's own, POD_NAMESPACE from the downward API);
    empty: the in-cluster service account's namespace, else default."""
    peering: str | None = None
    """Deprecated, ignored: leadership is a Lease now (--leader-elect-resource-name)."""
    priority: int | None = None
    """Deprecated, ignored: the first replica to take the Lease leads (no priorities)."""
    peering_lifetime: int | None = None
    """Deprecated, ignored: see --leader-elect-lease-duration."""
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
    nvidia.com/mig-*, comma-separated (e.g. a vendor's variant, Volcano's
    volcano.sh/vgpu-number)."""
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

    @field_validator("leader_elect_renew_deadline", "leader_elect_retry_period")
    @classmethod
    def _leader_timing(cls, value: float, info: ValidationInfo) -> float:
        """lease duration > renew deadline > retry period (fields are validated in order; one
        found invalid already is left to its own message)."""
        if info.field_name == "leader_elect_renew_deadline":
            lease = info.data.get("leader_elect_lease_duration")
            if lease is not None and value >= lease:
                raise ValueError(
                    f"must be shorter than --leader-elect-lease-duration ({lease} s), so that a "
                    "leader that cannot renew stops before another replica may take over"
                )
        else:
            deadline = info.data.get("leader_elect_renew_deadline")
            if deadline is not None and value >= deadline:
                raise ValueError(
                    f"must be shorter than --leader-elect-renew-deadline ({deadline:g} s), so "
                    "that the leader renews before its deadline passes"
                )
        return value

    @field_validator("namespace_selector")
    @classmethod
    def _selector(cls, value: str) -> str:
        parse_selector(value)  # a SelectorError (a ValueError) says what is wrong, and where
        return value

    def scope(self, labels: Callable[[str], Mapping[str, str] | None]) -> Scope:
        """Where the operator writes on pods, reading the namespaces' labels from `labels`."""
        selector = parse_selector(self.namespace_selector) if self.namespace_selector else None
        return Scope(self.pod_marks, selector, self.namespace_selector, labels)

    def deprecated_flags(self) -> list[str]:
        """What to say about each deprecated flag that was given: they are accepted, so an
        upgraded install keeps starting, and ignored."""
        replaced = {
            "peering": "--leader-elect-resource-name (the Lease; no ClusterKopfPeering)",
            "priority": "nothing: the first replica to take the Lease leads",
            "peering_lifetime": "--leader-elect-lease-duration",
        }
        return [
            f"{flag_name(field)} is ignored since leadership is a Lease; instead: {what}"
            for field, what in replaced.items()
            if getattr(self, field) is not None
        ]

    def leader_timing(self) -> Timing:
        return Timing(
            self.leader_elect_lease_duration,
            self.leader_elect_renew_deadline,
            self.leader_elect_retry_period,
        )

    def driver_namespace_set(self) -> frozenset[str]:
        return frozenset(comma_list(self.driver_namespaces))

    def allocation_rules(self) -> AllocationRules:
        """The three lists above, as the allocation rules take them."""
        return AllocationRules(
            extra_resources=comma_list(self.gpu_resources),
            fraction_annotations=comma_list(self.fraction_annotations),
            dra_drivers=comma_list(self.dra_drivers),
        )
