"""Small pure readings of a report that the agent, the operator and `gpuusage top` share."""

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


def share_moved(old: float | None, new: float | None, threshold: float) -> bool:
    """Whether a published share moved by `threshold` or more (or came or went), compared in
    thousandths, as shares are published: the agent's write rule and the operator's pod
    annotation both ask this, and floats would call 0.10 to 0.15 no move and 0.50 to 0.55 one."""
    if old is None or new is None:
        return old is not new
    return abs(round(old * 1000) - round(new * 1000)) >= round(threshold * 1000)
