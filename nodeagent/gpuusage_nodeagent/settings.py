"""The agent's settings: every flag, its environment variable, default and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gpuusage.settings import CommandSettings
from gpuusage_nodeagent.change import DEFAULT_SHARE_THRESHOLD
from gpuusage_nodeagent.driverupgrade import UPGRADE_STATE_LABEL
from gpuusage_nodeagent.share import DEFAULT_READ_EVERY, DEFAULT_WINDOW


class AgentSettings(CommandSettings):
    node_name: Annotated[str, Field(max_length=253)] = Field(
        default="", json_schema_extra={"env": ["NODE_NAME"]}
    )
    """The node this agent reports for (in a DaemonSet: NODE_NAME from the downward API)."""
    interval: float = Field(default=10.0, gt=0)
    """Seconds between observations."""
    allow_old_kubernetes: bool = False
    """Run on a cluster older than the oldest supported Kubernetes (gpuusage.kube.serverversion:
    1.35), where nothing proves what the kubelet's PodResources answers mean; otherwise such a
    cluster is refused at start with the floor and the reason."""
    lease_namespace: str = Field(
        default="", max_length=63, json_schema_extra={"env": ["POD_NAMESPACE"]}
    )
    """Namespace of the agent's Lease, named after its node (in a DaemonSet: POD_NAMESPACE
    from the downward API). Empty: no Lease; the report is then rewritten every --heartbeat,
    which is how the operator knows the agent is alive."""
    lease_duration: float = Field(default=60.0, ge=10, le=3600)
    """Seconds the Lease stays valid; renewed every third of it. The default renews every 20 s:
    half the kubelets' node Lease writes (every 10 s), and a node whose agent stopped goes
    stale within 60 s of its last renewal."""
    report_refresh: float = Field(default=300.0, gt=0)
    """With a Lease, once the report's status says the operator judges the node by it: seconds
    after which an unchanged report is written anyway (as the kubelet writes its Node status
    every 5 minutes); between refreshes a steady node writes nothing but Lease renewals."""
    heartbeat: float = Field(default=60.0, gt=0)
    """Without a Lease, or while the operator does not judge the node by it (an operator of an
    earlier version, one that cannot read Leases): seconds after which an unchanged report is
    written anyway, so that the operator sees the agent alive."""
    memory_threshold_mib: int = Field(default=64, ge=1)
    """Memory changes smaller than this (per process and per device) do not cause a write."""
    unexplained_memory_mib: int = Field(default=256, ge=0)
    """Memory in use on a device beyond the driver's reserved part and what its listed
    processes hold, in MiB, above which (plus --context-memory-mib for each listed process) the
    device is reported as one whose processes NVML does not all list (ProcessesNotVisible): its
    pods' use is then unknown, never ended."""
    context_memory_mib: int = Field(default=8, ge=0, le=1024)
    """MiB allowed per listed process on top of --unexplained-memory-mib: the driver keeps
    memory of its own for every CUDA context that no process is charged with (5.8 MiB measured
    on driver 580), so a GPU shared by many processes is not taken for one that hides some."""
    gpu_source: str = "nvml"
    """nvml (the driver), none (no GPUs), or fake:PATH (a scenario file)."""
    proc_root: Path = Path("/proc")
    """Where the host's processes are visible (the host's /proc when not using hostPID)."""
    attribution_grace: float = Field(default=120.0, ge=0)
    """Seconds a process the GPU library still lists keeps the pod last read for it while its
    /proc files cannot be read; after that its pod's use is reported as unknown (never as
    ended)."""
    idle_window: float = Field(default=300.0, gt=0)
    """Seconds a process must use none of its device's engines before it is published as idle
    (`idleSince`); shorter pauses are no change, so utilization noise causes no write. On a GPU
    many processes share, the driver's sampler may need longer to show a quiet process is not
    merely unsampled: until it does, the process is published with its activity unknown, never
    idle (docs/real-driver.md has the time each process count needs)."""
    share_window: float = Field(default=DEFAULT_WINDOW.total_seconds())
    """Seconds over which each process's share of its device's time (`computeShare`) is
    counted from the driver's sampler; 0 turns the share off (no reads beyond the cycle's).
    A share is published once the reads cover half of it."""
    share_read_every: float = Field(default=DEFAULT_READ_EVERY, ge=0.2, le=10)
    """Seconds between two reads of the sampler of a GPU that several processes share, for
    their shares (a GPU with one process gets its share from the cycle's reads alone). Longer
    costs less and measures less precisely (docs/real-driver.md has both)."""
    share_threshold: float = Field(default=DEFAULT_SHARE_THRESHOLD, gt=0, le=1)
    """A process's share moving by less than this (0.05: 5 points of its device's time) since
    it was last published causes no write, nor one within the estimates' own noise, which the
    share window and the sampler instants set (see change.share_noise)."""
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    """The kubelet's PodResources socket, read each cycle for the device IDs each pod was given
    (mount its folder read-only); when its folder is not there, allocations stay counts."""
    pod_resources_timeout: float = Field(default=2.0, gt=0, le=30)
    """Seconds the kubelet has to answer."""
    pod_resources_refresh: float = Field(default=60.0, gt=0)
    """Seconds after which the kubelet is asked again although no new pod uses a GPU (a new
    pod is asked about in the cycle it appears)."""
    cdi_spec_dirs: str = "/etc/cdi,/var/run/cdi"
    """The host's CDI spec folders, comma-separated, in rising priority (the CDI library's
    defaults): the CDI devices DRA drivers prepared are looked up there for their GPU's UUID
    (mount them read-only); folders that are not there hold no specs."""
    gpu_resources: str = ""
    """Extra extended-resource names whose kubelet device IDs are GPUs, comma-separated (give
    the operator the same list)."""
    driver_upgrade_label: str = Field(default=UPGRADE_STATE_LABEL, max_length=317)
    """The label on the agent's own Node by which the GPU Operator tells a driver upgrade's
    state. While it says the driver is about to be unloaded or is being replaced
    (pod-deletion-required, drain-required, pod-restart-required, node-maintenance-required,
    post-maintenance-required), or nvidia.com/gpu.deploy.client holds paused-for- (the driver
    manager's paused-for-driver-upgrade, the MIG manager's paused-for-mig-change), the agent
    shuts NVML down, holds no /dev/nvidia* open and reports the node as DriverUpgrade; it reads
    the GPUs again once neither says so (a driver of another version: it exits, status 3, to be
    started again with that driver's library). Empty: the Node is never read (neither label;
    the agent needs no `get` on nodes)."""
    driver_upgrade_read_every: float = Field(default=30.0, ge=1, le=600)
    """Seconds between two reads of the agent's own Node for that label (from the apiserver's
    cache: resourceVersion=0)."""
    kubeconfig: Path | None = None
    """Kubeconfig file; else $KUBECONFIG, the in-cluster service account, ~/.kube/config."""
    once: bool = False
    """Do one cycle, then exit."""
    output: Literal["json"] | None = None
    """With --once: print the GpuNodeUsage object to stdout and write nothing to any API."""
    metrics_port: int = Field(default=9747, ge=0, le=65535)
    """Port of the Prometheus endpoint; 0 turns it off."""
    metrics_address: str = "0.0.0.0"
    """Address the Prometheus endpoint listens on."""

    @field_validator("gpu_source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value in ("nvml", "none") or (value.startswith("fake:") and len(value) > 5):
            return value
        raise ValueError("must be nvml, none or fake:PATH")

    @field_validator("share_window")
    @classmethod
    def _share_window(cls, value: float) -> float:
        if value == 0 or value >= 10:
            return value
        raise ValueError("must be 0 (off) or at least 10 seconds")

    @model_validator(mode="after")
    def _combination(self) -> AgentSettings:
        if self.output is not None and not self.once:
            raise ValueError("--output json needs --once")
        if not self.node_name:
            raise ValueError("--node-name (or NODE_NAME) is required")
        if self.lease_namespace and self.interval > self.lease_duration / 3:
            raise ValueError(
                "--interval must be at most a third of --lease-duration: the Lease is renewed "
                "after a cycle, every third of its duration, and two renewals may fail before "
                "it lapses"
            )
        return self
