"""Keep what the agent publishes within the API's bounds. Pure.

A report lists at most MAX_PROCESSES processes on the whole node (and sources read at most
MAX_GPUS GPUs), so that the object stays far below etcd's request limit (see api.models). One
busy node must not turn every write into a refusal and the node into a stale one: when more
processes run, the largest by memory are listed, and each device counts the rest
(`omittedProcesses`, `omittedMemoryMiB`), which the operator reads as "this device was not
fully reported".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gpuusage.api.models import MAX_MIB, MAX_PROCESSES, Gpu, MigDevice
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading

Omitted = Mapping[str, tuple[int, int]]
"""Device UUID → (processes left out, their memory in MiB)."""


def _largest_first(item: tuple[str, RawProcess]) -> tuple[int, int]:
    return -(item[1].used_memory_mib or 0), item[1].pid


def _with_omitted(device: Gpu | MigDevice, omitted: Omitted) -> dict[str, int | None]:
    count, mib = omitted.get(device.uuid or "", (0, 0))
    if count == 0:
        return {"omitted_processes": None, "omitted_memory_mib": None}
    return {"omitted_processes": count, "omitted_memory_mib": min(mib, MAX_MIB)}


def capped(reading: Reading, limit: int = MAX_PROCESSES) -> Reading:
    """The reading with at most `limit` processes, the largest by memory (ties: the lowest
    pid); what was left out is counted on its device."""
    processes = reading.processes
    listed = [(uuid, p) for uuid, procs in processes.items() for p in procs]
    if len(listed) <= limit:
        return reading
    ranked = sorted(listed, key=_largest_first)
    keep = {(uuid, p.pid) for uuid, p in ranked[:limit]}
    omitted: dict[str, tuple[int, int]] = {}
    for uuid, p in ranked[limit:]:
        count, mib = omitted.get(uuid, (0, 0))
        omitted[uuid] = (count + 1, mib + (p.used_memory_mib or 0))
    trimmed = {
        uuid: [p for p in procs if (uuid, p.pid) in keep] for uuid, procs in processes.items()
    }
    marked = [
        gpu.model_copy(
            update={
                **_with_omitted(gpu, omitted),
                "mig_devices": [
                    m.model_copy(update=_with_omitted(m, omitted)) for m in gpu.mig_devices
                ],
            }
        )
        for gpu in reading.gpus
    ]
    return replace(reading, gpus=marked, processes=trimmed)
