"""The GpuNodeUsage status the operator wants, from (report, pods, now). Pure.

The status answers "who uses this node's GPUs" without any other lookup: pods per device with
their containers, pids and memory; processes that belong to no pod, with the reason; totals for
`kubectl get`; and two conditions, `Stale` (is the agent still reporting?) and `Ready` (fresh and
reconciled: what `kubectl wait --for=condition=Ready` reads). Lists are sorted so that an
unchanged report always yields an identical status, which is what lets the operator skip writes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta

from gpuusage.api import names
from gpuusage.api.models import (
    MAX_UNATTRIBUTED,
    Condition,
    ContainerUsage,
    DeviceUsage,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
    PodUsage,
    UnattributedProcess,
)
from gpuusage.api.summary import totals
from gpuusage.operator.freshness import DEFAULT_STALE_AFTER, stale_condition
from gpuusage.operator.resolution import Resolution

MAX_PIDS_LISTED = 64


def _condition(previous: Iterable[Condition], new: Condition) -> Condition:
    """Keep lastTransitionTime when the status did not change."""
    for old in previous:
        if old.type == new.type and old.status == new.status:
            return new.model_copy(update={"last_transition_time": old.last_transition_time})
    return new


def device_usages(resolutions: Iterable[Resolution]) -> list[DeviceUsage]:
    """Resolved pods per device, containers per pod, sorted for stable output."""
    grouped: dict[str, dict[str, list[Resolution]]] = defaultdict(lambda: defaultdict(list))
    for r in resolutions:
        if r.pod is not None:
            grouped[r.device_uuid][r.pod.uid].append(r)
    devices = []
    for uuid in sorted(grouped):
        pods = []
        for entries in grouped[uuid].values():
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
            pods.append(
                PodUsage(
                    namespace=pod.namespace,
                    name=pod.name,
                    uid=pod.uid,
                    containers=containers,
                    used_memory_mib=sum(c.used_memory_mib for c in containers),
                    requested_gpus=min(pod.gpu_requests, 1024),
                    unrequested=pod.gpu_requests == 0,
                )
            )
        pods.sort(key=lambda p: (p.namespace, p.name, p.uid))
        devices.append(DeviceUsage(uuid=uuid, pods=pods))
    return devices


def unattributed(resolutions: Iterable[Resolution]) -> list[UnattributedProcess]:
    found = [
        UnattributedProcess(
            pid=r.process.pid,
            name=r.process.name,
            device_uuid=r.device_uuid,
            used_memory_mib=r.process.used_memory_mib,
            reason=r.reason,
            message=r.message[:1024],
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
    previous: GpuNodeUsageStatus | None = None,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> GpuNodeUsageStatus:
    """The status for this report."""
    old_conditions = previous.conditions if previous else []
    stale = stale_condition(
        spec.observed_at,
        now,
        stale_after,
        previous=next((c for c in old_conditions if c.type == names.CONDITION_STALE), None),
        generation=generation,
    )
    if stale.status == "True":
        ready = Condition(
            type=names.CONDITION_READY, status="False", observed_generation=generation,
            last_transition_time=now.replace(microsecond=0), reason="ReportStale",
            message=stale.message,
        )  # fmt: skip
    else:
        ready = Condition(
            type=names.CONDITION_READY, status="True", observed_generation=generation,
            last_transition_time=now.replace(microsecond=0), reason="Reconciled",
            message="the latest report is fresh and its processes are resolved to pods",
        )  # fmt: skip
    ready = _condition(old_conditions, ready)
    devices = device_usages(resolutions)
    outside = unattributed(resolutions)
    pods = {p.uid for d in devices for p in d.pods}
    unrequested = {p.uid for d in devices for p in d.pods if p.unrequested}
    node_totals = totals(spec, pods=len(pods), unattributed=len(outside))
    return GpuNodeUsageStatus(
        observed_generation=generation,
        conditions=[ready, stale],
        totals=node_totals.model_copy(update={"unrequested_pods": len(unrequested)}),
        devices=devices,
        unattributed=outside[:MAX_UNATTRIBUTED],
    )
