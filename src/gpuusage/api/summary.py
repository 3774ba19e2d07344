"""Small pure readings of a report that the operator and `gpuusage top` share."""

from __future__ import annotations

from collections.abc import Iterator

from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Process


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
