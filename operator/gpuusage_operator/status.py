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
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from gpuusage.api import names
from gpuusage.api.models import (
    MAX_DETAIL,
    MAX_DEVICES,
    MAX_IDLE_PODS,
    MAX_PIDS_LISTED,
    MAX_POD_DEVICES,
    MAX_REQUESTED_GPUS,
    MAX_UNATTRIBUTED,
    Condition,
    ContainerUsage,
    DeviceUsage,
    Gpu,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
    IdlePod,
    MigDevice,
    PodUsage,
    UnattributedProcess,
    safe_text,
)
from gpuusage.api.summary import device_uuid, totals
from gpuusage_operator.freshness import DEFAULT_STALE_AFTER, Sighting, stale_condition
from gpuusage_operator.resolution import Resolution


def _condition(previous: Iterable[Condition], new: Condition) -> Condition:
    """Keep lastTransitionTime when the status did not change."""
    for old in previous:
        if old.type == new.type and old.status == new.status:
            return new.model_copy(update={"last_transition_time": old.last_transition_time})
    return new


def pod_usages(resolutions: Iterable[Resolution]) -> list[PodUsage]:
    """One entry per (pod, device), containers per entry, sorted for stable output."""
    grouped: dict[tuple[str, str], list[Resolution]] = defaultdict(list)
    for r in resolutions:
        if r.pod is not None:
            grouped[(r.pod.uid, r.device_uuid)].append(r)
    usages = []
    for (_uid, uuid), entries in grouped.items():
        pod = entries[0].pod
        assert pod is not None
        by_container: dict[tuple[str | None, str | None], list[Resolution]] = defaultdict(list)
        for r in entries:
            by_container[(r.container_name, r.process.container_id)].append(r)
        containers = [
            ContainerUsage(
                name=name,
                container_id=cid,
                pids=sorted(r.process.pid for r in items)[:MAX_PIDS_LISTED],
                used_memory_mib=sum(r.process.used_memory_mib or 0 for r in items),
            )
            for (name, cid), items in sorted(
                by_container.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or "")
            )
        ]
        usages.append(
            PodUsage(
                namespace=pod.namespace,
                name=pod.name,
                uid=pod.uid,
                device_uuid=uuid,
                containers=containers,
                used_memory_mib=sum(c.used_memory_mib for c in containers),
                requested_gpus=min(pod.gpu_requests, MAX_REQUESTED_GPUS),
                unrequested=pod.gpu_requests == 0,
            )
        )
    usages.sort(key=lambda u: (u.namespace, u.name, u.uid, u.device_uuid))
    return usages


def device_usages(spec: GpuNodeUsageSpec, resolutions: Iterable[Resolution]) -> list[DeviceUsage]:
    """Every device of the report with its memory and what its processes resolved to."""
    on: dict[str, list[Resolution]] = defaultdict(list)
    for r in resolutions:
        on[r.device_uuid].append(r)

    def summary(uuid: str, index: int, parent: str | None, device: Gpu | MigDevice) -> DeviceUsage:
        found = on.get(uuid, [])
        memory = device.memory
        outside = [r for r in found if r.pod is None]
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


def desired_status(
    spec: GpuNodeUsageSpec,
    resolutions: list[Resolution],
    now: datetime,
    *,
    generation: int | None,
    sighting: Sighting,
    previous: GpuNodeUsageStatus | None = None,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
    idle: Sequence[IdlePod] = (),
) -> GpuNodeUsageStatus:
    """The status for this report; `sighting` says when the operator saw it change, `idle`
    are the pods the caller judged idle (see idle)."""
    old_conditions = previous.conditions if previous else []
    stale = stale_condition(
        sighting,
        now,
        stale_after,
        previous=next((c for c in old_conditions if c.type == names.CONDITION_STALE), None),
        generation=generation,
    )
    if stale.status == "True":
        ready = Condition(
            type=names.CONDITION_READY,
            status="False",
            observed_generation=generation,
            last_transition_time=now.replace(microsecond=0),
            reason="ReportStale",
            message=stale.message,
        )
    else:
        ready = Condition(
            type=names.CONDITION_READY,
            status="True",
            observed_generation=generation,
            last_transition_time=now.replace(microsecond=0),
            reason="Reconciled",
            message="the latest report is fresh and its processes are resolved to pods",
        )
    ready = _condition(old_conditions, ready)
    usages = pod_usages(resolutions)
    outside = unattributed(resolutions)
    node_totals = totals(spec, pods=len({u.uid for u in usages}), unattributed=len(outside))
    return GpuNodeUsageStatus(
        observed_generation=generation,
        report_seen_at=sighting.seen_at.replace(microsecond=0),
        conditions=[ready, stale],
        totals=node_totals.model_copy(
            update={
                "unattributed_memory_mib": sum(u.used_memory_mib or 0 for u in outside),
                "unrequested_pods": len({u.uid for u in usages if u.unrequested}),
                "idle_pods": len(idle),
            }
        ),
        devices=device_usages(spec, resolutions),
        pods=usages[:MAX_POD_DEVICES],
        unattributed=outside[:MAX_UNATTRIBUTED],
        idle_pods=sorted(idle, key=lambda i: (i.namespace, i.name, i.uid))[:MAX_IDLE_PODS],
    )
