"""Build the GpuNodeUsage spec from a reading and the pids' attributions. Pure.

Kept apart from I/O so that every attribution rule (name fallback, unresolvable pids) is tested
without a proc tree, and so that the benchmark measures the real code path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpuusage.api.models import (
    MAX_DETAIL,
    MAX_MESSAGE,
    DeviceError,
    Gpu,
    GpuNodeUsageSpec,
    KubeletAllocations,
    MigDevice,
    Process,
    Source,
    safe_text,
)
from gpuusage_nodeagent.activity import Key
from gpuusage_nodeagent.change import Exact, Fingerprint, Shared, fingerprint
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading
from gpuusage_nodeagent.resolver import MAX_NAME, Resolved
from gpuusage_nodeagent.share import Share


def reading_pids(reading: Reading) -> set[int]:
    """Every pid the reading lists, on GPUs and MIG devices."""
    return {p.pid for listed in reading.processes.values() for p in listed}


Attributed = tuple[str | None, str | None, str | None, str | None]
"""(name, container ID, pod UID, resolve error)."""


def attribution(process: RawProcess, resolved: Resolved | None) -> Attributed:
    """The fields the resolver decides: the one rule behind the published process and the
    write rule's key."""
    if resolved is None:  # not looked up at all: nothing is known beyond the reading
        return process.name, None, None, None
    found = resolved.attribution
    return process.name or resolved.comm, found.container_id, found.pod_uid, resolved.error


def attribute(
    process: RawProcess,
    resolved: Resolved | None,
    idle_since: datetime | None = None,
    share: Share | None = None,
) -> Process:
    """The published process: what the GPU library said, with its container, pod and name
    filled in from what the proc root said, since when it is idle (see activity) and its share
    of the device (see share). Validated here, once per write."""
    name, container_id, pod_uid, error = attribution(process, resolved)
    return Process(
        pid=process.pid,
        name=None if name is None else safe_text(name, MAX_NAME),
        used_memory_mib=process.used_memory_mib,
        container_id=container_id,
        pod_uid=pod_uid,
        types=list(process.types),
        sm_util_percent=process.sm_util_percent,
        memory_util_percent=process.memory_util_percent,
        compute_share=None if share is None else shown_share(share.value),
        compute_share_samples=None if share is None else share.samples,
        compute_share_seconds=None if share is None else round(share.seconds, 1),
        resolve_error=None if error is None else safe_text(error, MAX_DETAIL),
        idle_since=idle_since,
        activity_unknown=process.active is None,
    )


def shown_share(value: float) -> float:
    """A share as published: to a thousandth, within 0..1."""
    return min(max(round(value, 3), 0.0), 1.0)


Idle = Mapping[Key, datetime]
"""Since when each idle process is idle, by (device UUID, pid)."""
NOT_IDLE: Idle = {}
Shares = Mapping[Key, Share]
"""Each process's compute share, by (device UUID, pid); absent where not known."""
NO_SHARES: Shares = {}


def _attribute_all(
    device: Gpu | MigDevice,
    reading: Reading,
    found: Mapping[int, Resolved],
    idle: Idle,
    shares: Shares,
) -> list[Process]:
    uuid = device.uuid or ""
    return [
        attribute(p, found.get(p.pid), idle.get((uuid, p.pid)), shares.get((uuid, p.pid)))
        for p in reading.processes_of(device)
    ]


def build_spec(
    node_name: str,
    observed_at: datetime,
    reading: Reading,
    found: Mapping[int, Resolved],
    *,
    kubelet: KubeletAllocations | None = None,
    idle: Idle = NOT_IDLE,
    shares: Shares = NO_SHARES,
) -> GpuNodeUsageSpec:
    """The spec the agent publishes for this reading."""
    gpus: list[Gpu] = []
    for gpu in reading.gpus:
        migs = [
            mig.model_copy(update={"processes": _attribute_all(mig, reading, found, idle, shares)})
            for mig in gpu.mig_devices
        ]
        processes = _attribute_all(gpu, reading, found, idle, shares)
        gpus.append(gpu.model_copy(update={"processes": processes, "mig_devices": migs}))
    return GpuNodeUsageSpec(
        node_name=node_name,
        observed_at=observed_at,
        source=reading.source,
        gpus=gpus,
        kubelet=kubelet,
    )


REFUSED_REASON = "ReportRefused"


def without_processes(spec: GpuNodeUsageSpec, refusal: str) -> GpuNodeUsageSpec:
    """What to publish when the API refused `spec` for good (too large, invalid): every device
    without its processes and with an error saying why, and the refusal in `source.message`.

    The operator reads a device with an error as one it cannot see: the node's pods become
    Unknown, never "ended", and the node is not left stale for a reason nobody can read.
    """
    why = safe_text(f"the API refused this node's full report: {refusal}", MAX_DETAIL)
    error = DeviceError(reason=REFUSED_REASON, message=why)
    note = f"{why}; devices are reported without their processes until the observation changes"
    gpus = [
        gpu.model_copy(
            update={
                "processes": [],
                "error": gpu.error or error,
                "mig_devices": [
                    m.model_copy(update={"processes": [], "error": m.error or error})
                    for m in gpu.mig_devices
                ],
            }
        )
        for gpu in spec.gpus
    ]
    source = (spec.source or Source(kind="none", available=True)).model_copy(
        update={"message": safe_text(note, MAX_MESSAGE)}
    )
    return spec.model_copy(update={"gpus": gpus, "source": source})


@dataclass
class AttributedReading:
    """One cycle's reading with the resolver's answers; the spec is built only when asked for.

    Most cycles publish nothing (the write rule needs only the fingerprint), and building the
    spec, a validated model per process, was the largest cost of a cycle at hundreds of
    processes.
    """

    node_name: str
    observed_at: datetime
    reading: Reading
    found: Mapping[int, Resolved]
    kubelet: KubeletAllocations | None = None
    """The kubelet's allocations this cycle; None: not read (the socket is not mounted)."""
    idle: Idle = field(default_factory=dict)
    """Idle processes, since when (see activity)."""
    shares: Shares = field(default_factory=dict)
    """Each process's compute share where known (see share)."""
    _spec: GpuNodeUsageSpec | None = field(default=None, repr=False)

    def spec(self) -> GpuNodeUsageSpec:
        if self._spec is None:
            self._spec = build_spec(
                self.node_name,
                self.observed_at,
                self.reading,
                self.found,
                kubelet=self.kubelet,
                idle=self.idle,
                shares=self.shares,
            )
        return self._spec

    def fingerprint(self) -> Fingerprint:
        """What the write rule compares, from the reading and the attributions directly; the
        kubelet's answer is compared whole (it changes only when pods come and go)."""
        found = fingerprint(
            self.node_name,
            self.reading.source,
            self.reading.gpus,
            self.reading.processes_of,
            self._key,
            share_of=self._share if self.shares else None,
        )
        return Fingerprint((*found.exact, self.kubelet), found.memories, found.shares)

    def _share(self, device: Gpu | MigDevice, p: RawProcess) -> Shared | None:
        share = self.shares.get((device.uuid or "", p.pid))
        return None if share is None else (shown_share(share.value), share.samples)

    def _key(self, device: Gpu | MigDevice, p: RawProcess) -> Exact:
        name, container_id, pod_uid, error = attribution(p, self.found.get(p.pid))
        idle = self.idle.get((device.uuid or "", p.pid)) if self.idle else None
        return p.pid, name, container_id, pod_uid, p.types, error, idle, p.active is None

    def unresolved(self) -> int:
        """Processes the resolver could not attribute (for the agent's metrics)."""
        return sum(
            1 for p in self.reading.all_processes() if (r := self.found.get(p.pid)) and r.error
        )
