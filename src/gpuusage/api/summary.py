"""Pure summaries of a report: the totals behind the printer columns.

Kept beside the models because both the operator (status) and tools that only read a spec
(the CLI, the demo) need the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Process, Totals


def device_uuid(gpu: Gpu) -> str:
    """The GPU's UUID, or a stand-in for a GPU that failed before its UUID could be read."""
    return gpu.uuid or f"gpu-index-{gpu.index}"


def all_processes(spec: GpuNodeUsageSpec) -> Iterator[tuple[str, Process]]:
    """Every (device UUID, process) pair, MIG devices included."""
    for gpu in spec.gpus:
        for process in gpu.processes:
            yield device_uuid(gpu), process
        for mig in gpu.mig_devices:
            for process in mig.processes:
                yield mig.uuid, process


def format_mib(mib: int) -> str:
    """A compact human form: 512Mi, 80Gi, 10.3Gi."""
    if mib < 1024:
        return f"{mib}Mi"
    gib = mib / 1024
    return f"{gib:.0f}Gi" if gib == int(gib) else f"{gib:.1f}Gi"


def totals(spec: GpuNodeUsageSpec, pods: int, unattributed: int) -> Totals:
    """Node totals given how many pods the caller resolved and how many processes it could not.

    A process listed under several devices (rare, but NVML allows it) counts once per device:
    each listing holds memory on that device.
    """
    listed = list(all_processes(spec))
    used = sum(p.used_memory_mib or 0 for _, p in listed)
    total = sum(g.memory.total_mib for g in spec.gpus if g.memory is not None)
    return Totals(
        gpus=len(spec.gpus),
        pods=pods,
        processes=len(listed),
        used_memory_mib=used,
        total_memory_mib=total,
        unattributed_processes=unattributed,
        memory=f"{format_mib(used)}/{format_mib(total)}",
    )
