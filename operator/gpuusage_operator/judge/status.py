"""The GpuNodeUsage status the operator wants, from (report, pods, now). Pure.

The status answers "who uses this node's GPUs" without any other lookup: every device with its
memory and how much of it no pod explains; one entry per pod and device with containers, pids,
memory and the pod's GPU request; processes that belong to no pod, with the reason; running pods
that requested GPUs and leave them idle; totals for `kubectl get`; and two conditions, `Stale`
(is the agent still reporting?) and `Ready` (fresh and reconciled: what `kubectl wait
--for=condition=Ready` reads). Lists are sorted so that an unchanged report always yields an
identical status, which is what lets the operator skip writes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

from gpuusage.api import names
from gpuusage.api.models import (
    MAX_ALLOCATED,
    MAX_ALLOCATED_LISTED,
    MAX_DETAIL,
    MAX_DEVICES,
    MAX_IDLE_PODS,
    MAX_MIB,
    MAX_PIDS_LISTED,
    MAX_POD_DEVICES,
    MAX_UNATTRIBUTED,
    Condition,
    ContainerUsage,
    DeviceUsage,
    Gpu,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
    IdlePod,
    MigDevice,
    PodAllocation,
    PodUsage,
    Process,
    Totals,
    UnattributedProcess,
    safe_text,
)
from gpuusage.api.reasons import ReadyReason
from gpuusage.api.summary import all_processes, device_uuid, format_mib
from gpuusage_operator.judge.allocation import AllocatedDevice, Judgement, judgements
from gpuusage_operator.judge.certainty import BlindSpots, blind_spots
from gpuusage_operator.judge.freshness import Freshness, stale_condition
from gpuusage_operator.judge.holding import computing
from gpuusage_operator.judge.orphaned import orphaned_memory
from gpuusage_operator.judge.requests import share_of
from gpuusage_operator.judge.resolution import PodUse, Resolution, pod_uses
from gpuusage_operator.judge.transitions import transition_time


def pod_usages(uses: Iterable[PodUse], pod_judgements: Mapping[str, Judgement]) -> list[PodUsage]:
    """One entry per (pod, device), containers per entry, with the pod's allocation beside
    each; sorted for stable output, allocated devices listed within the status's budget."""
    usages = []
    for use in uses:
        judgement = pod_judgements[use.pod.uid]
        allocation = judgement.allocation
        on_device: dict[str, list[Resolution]] = defaultdict(list)
        for r in use.resolutions:
            on_device[r.device_uuid].append(r)
        for uuid, entries in on_device.items():
            by_container: dict[tuple[str | None, str | None], list[Resolution]] = defaultdict(list)
            for r in entries:
                by_container[(r.container_name, r.process.container_id)].append(r)
            containers = [
                ContainerUsage(
                    name=name,
                    pids=sorted(r.process.pid for r in items)[:MAX_PIDS_LISTED],
                    used_memory_mib=sum(r.process.used_memory_mib or 0 for r in items),
                )
                for (name, _), items in sorted(
                    by_container.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or "")
                )
            ]
            usages.append(
                PodUsage(
                    namespace=use.pod.namespace,
                    name=use.pod.name,
                    uid=use.pod.uid,
                    device_uuid=uuid,
                    containers=containers,
                    used_memory_mib=sum(c.used_memory_mib for c in containers),
                    requested_gpus=use.pod.gpu_requests,
                    unrequested=judgement.finding == "Unrequested",
                    allocated_by=list(allocation.sources),
                    unallocated=judgement.finding == "Unallocated" and uuid in judgement.outside,
                    held_idle_since=judgement.held_idle_since,
                    computing=computing(r.process for r in entries),
                    compute_share=compute_share(r.process for r in entries),
                    handed_share=handed_share(allocation.devices, uuid, use.pod.fraction),
                    handed_memory_mib=handed_memory(allocation.devices, uuid),
                )
            )
    usages.sort(key=lambda u: (u.namespace, u.name, u.uid, u.device_uuid))
    return list_allocated(usages, pod_judgements)


def compute_share(processes: Iterable[Process]) -> float | None:
    """A pod's share of a device: its processes' shares added up (at most 1, as they are of
    one device's time); None when none of them has one."""
    shares = [p.compute_share for p in processes if p.compute_share is not None]
    return min(round(sum(shares), 3), 1.0) if shares else None


def handed_share(devices: Iterable[AllocatedDevice], uuid: str, fraction: str) -> float | None:
    """The share of this device's time the pod was handed: a DRA claim's part of a shared
    device or that shares it (see allocation.handed_part) or the device plugin's time-slicing
    replicas it was given (see allocation.replica_share), else a fractional scheduler's
    gpu-fraction (up to 1; more is GPUs, not a share of one)."""
    claimed = [d.share for d in devices if d.uuid == uuid and d.share is not None]
    if claimed:
        return min(sum(claimed), 1.0)
    gpu = share_of(fraction).gpu
    return gpu if gpu is not None and gpu <= 1 else None


def handed_memory(devices: Iterable[AllocatedDevice], uuid: str) -> int | None:
    """The GPU memory of this device the pod was handed where its claims parted it out (see
    allocation.consumed_part); None where none did."""
    parted = [d.memory_mib for d in devices if d.uuid == uuid and d.memory_mib is not None]
    return min(sum(parted), MAX_MIB) if parted else None


def list_allocated(
    usages: list[PodUsage], pod_judgements: Mapping[str, Judgement]
) -> list[PodUsage]:
    """Each entry's allocated devices, in entry order until MAX_ALLOCATED_LISTED are listed
    (at most MAX_ALLOCATED per entry); the rest counted per entry as omitted, so a node of many
    pods with many devices each never grows the status past its bound."""
    budget = MAX_ALLOCATED_LISTED
    listed = []
    for usage in usages:
        shown = [d.shown for d in pod_judgements[usage.uid].allocation.devices]
        keep = shown[: min(MAX_ALLOCATED, budget)]
        budget -= len(keep)
        omitted = len(shown) - len(keep)
        listed.append(
            usage.model_copy(
                update={
                    "allocated_devices": keep,
                    "allocated_devices_omitted": omitted or None,
                }
            )
        )
    return listed


def device_usages(
    spec: GpuNodeUsageSpec, resolutions: Iterable[Resolution], blind: BlindSpots
) -> list[DeviceUsage]:
    """Every device of the report with its memory, what its processes resolved to, and why
    it cannot be seen whole where it cannot."""
    on: dict[str, list[Resolution]] = defaultdict(list)
    for r in resolutions:
        on[r.device_uuid].append(r)

    def summary(uuid: str, index: int, parent: str | None, device: Gpu | MigDevice) -> DeviceUsage:
        found = on.get(uuid, [])
        memory = device.memory
        outside = [r for r in found if r.pod is None and r.reason != "DriverProcess"]
        return DeviceUsage(
            uuid=uuid,
            index=index,
            parent_uuid=parent,
            total_memory_mib=memory.total_mib if memory else None,
            used_memory_mib=memory.used_mib if memory else None,
            processes=len(found),
            pods=len({r.pod.uid for r in found if r.pod is not None}),
            unattributed_processes=len(outside),
            unattributed_memory_mib=sum(r.process.used_memory_mib or 0 for r in outside),
            omitted_processes=device.omitted_processes,
            omitted_memory_mib=device.omitted_memory_mib,
            blind=None if (cause := blind.on(uuid)) is None else cause.reason,
        )

    devices = []
    for gpu in spec.gpus:
        uuid = device_uuid(gpu)
        devices.append(summary(uuid, gpu.index, None, gpu))
        devices += [summary(m.uuid, gpu.index, uuid, m) for m in gpu.mig_devices]
    return devices[:MAX_DEVICES]


def unattributed(resolutions: Iterable[Resolution]) -> list[UnattributedProcess]:
    found = [
        UnattributedProcess(
            pid=r.process.pid,
            name=r.process.name,
            device_uuid=r.device_uuid,
            used_memory_mib=r.process.used_memory_mib,
            reason=r.reason,
            message=safe_text(r.message, MAX_DETAIL),
        )
        for r in resolutions
        if r.pod is None and r.reason is not None
    ]
    found.sort(key=lambda u: (u.device_uuid, u.pid))
    return found


def node_totals(
    spec: GpuNodeUsageSpec,
    usages: Sequence[PodUsage],
    outside: Sequence[UnattributedProcess],
    idle_pods: int,
    devices: Sequence[DeviceUsage] = (),
) -> Totals:
    """The printer columns' numbers. A process listed under several devices (rare, but NVML
    allows it) counts once per device: each listing holds memory on that device."""
    listed = [p for _, p in all_processes(spec)]
    strays = [u for u in outside if u.reason != "DriverProcess"]  # a driver's are explained
    used = sum(p.used_memory_mib or 0 for p in listed)
    total = sum(g.memory.total_mib for g in spec.gpus if g.memory is not None)
    return Totals(
        gpus=len(spec.gpus),
        pods=len({u.uid for u in usages}),
        processes=len(listed),
        used_memory_mib=used,
        total_memory_mib=total,
        unattributed_processes=len(strays),
        unattributed_memory_mib=sum(u.used_memory_mib or 0 for u in strays),
        unrequested_pods=len({u.uid for u in usages if u.unrequested}),
        unallocated_pods=len({u.uid for u in usages if u.unallocated}),
        held_idle_pods=len({u.uid for u in usages if u.held_idle_since is not None}),
        idle_pods=idle_pods,
        blind_devices=sum(1 for d in devices if d.blind is not None),
        memory=f"{format_mib(used)}/{format_mib(total)}",
    )


def _ready(stale: Condition, generation: int | None, now: datetime) -> Condition:
    reason: ReadyReason
    if stale.status == "True":
        reason, status, message = "ReportStale", "False", stale.message
    else:
        reason, status = "Reconciled", "True"
        message = "the latest report is fresh and its processes are resolved to pods"
    return Condition(
        type=names.CONDITION_READY,
        status=status,
        observed_generation=generation,
        last_transition_time=now.replace(microsecond=0),
        reason=reason,
        message=message,
    )


def desired_status(
    spec: GpuNodeUsageSpec,
    resolutions: list[Resolution],
    now: datetime,
    *,
    generation: int | None,
    fresh: Freshness,
    previous: GpuNodeUsageStatus | None = None,
    idle: Sequence[IdlePod] = (),
    pod_judgements: Mapping[str, Judgement] | None = None,
    allocations: tuple[Sequence[PodAllocation], int | None] = ((), None),
    blind: BlindSpots | None = None,
) -> GpuNodeUsageStatus:
    """The status for this report; `fresh` says how fresh it is (see freshness), `idle`
    are the pods the caller judged idle (see idle), `pod_judgements` each using pod's
    allocation judgement (see allocation; by default one that knows no claims),
    `allocations` what each pod on the node was handed and how many were left out (see
    showback)."""
    old_conditions = previous.conditions if previous else []
    stale = stale_condition(
        fresh,
        now,
        previous=next((c for c in old_conditions if c.type == names.CONDITION_STALE), None),
        generation=generation,
    )
    ready = _ready(stale, generation, now)
    before = next((c for c in old_conditions if c.type == ready.type), None)
    ready = ready.model_copy(
        update={
            "last_transition_time": transition_time(
                None if before is None else before.status,
                None if before is None else before.last_transition_time,
                ready.status,
                ready.last_transition_time,
            )
        }
    )
    uses = pod_uses(spec.node_name, spec.observed_at, resolutions)
    judged = judgements(uses, spec) if pod_judgements is None else pod_judgements
    usages = pod_usages(uses.values(), judged)
    outside = unattributed(resolutions)
    devices = device_usages(
        spec, resolutions, blind_spots(spec, resolutions) if blind is None else blind
    )
    return GpuNodeUsageStatus(
        observed_generation=generation,
        report_seen_at=fresh.sighting.seen_at.replace(microsecond=0),
        conditions=[ready, stale],
        totals=node_totals(spec, usages, outside, len(idle), devices),
        orphaned=orphaned_memory(resolutions, previous.orphaned if previous else None, now),
        devices=devices,
        pods=usages[:MAX_POD_DEVICES],
        unattributed=outside[:MAX_UNATTRIBUTED],
        idle_pods=sorted(idle, key=lambda i: (i.namespace, i.name, i.uid))[:MAX_IDLE_PODS],
        allocations=list(allocations[0]),
        allocations_omitted=allocations[1],
    )
