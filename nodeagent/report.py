"""Build the GpuNodeUsage spec from a reading and the pids' attributions. Pure.

Kept apart from I/O so that every attribution rule (name fallback, unresolvable pids) is tested
without a proc tree, and so that the benchmark measures the real code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Process
from gpuusage.nodeagent.gpusource.base import Reading
from gpuusage.nodeagent.resolver import Resolved


def reading_pids(reading: Reading) -> set[int]:
    """Every pid the reading lists, on GPUs and MIG devices."""
    pids: set[int] = set()
    for gpu in reading.gpus:
        pids.update(p.pid for p in gpu.processes)
        for mig in gpu.mig_devices:
            pids.update(p.pid for p in mig.processes)
    return pids


def attribute(process: Process, resolved: Resolved | None) -> Process:
    """A process with its container, pod and name filled in from what the proc root said."""
    if resolved is None:
        return process
    return process.model_copy(
        update={
            "container_id": resolved.attribution.container_id,
            "pod_uid": resolved.attribution.pod_uid,
            "name": process.name or resolved.comm,
            "resolve_error": resolved.error,
        }
    )


def _attribute_all(processes: Iterable[Process], found: Mapping[int, Resolved]) -> list[Process]:
    return [attribute(p, found.get(p.pid)) for p in processes]


def build_spec(
    node_name: str, observed_at: datetime, reading: Reading, found: Mapping[int, Resolved]
) -> GpuNodeUsageSpec:
    """The spec the agent publishes for this reading."""
    gpus: list[Gpu] = []
    for gpu in reading.gpus:
        migs = [
            mig.model_copy(update={"processes": _attribute_all(mig.processes, found)})
            for mig in gpu.mig_devices
        ]
        gpus.append(
            gpu.model_copy(
                update={"processes": _attribute_all(gpu.processes, found), "mig_devices": migs}
            )
        )
    return GpuNodeUsageSpec(
        node_name=node_name, observed_at=observed_at, source=reading.source, gpus=gpus
    )
