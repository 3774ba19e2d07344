"""The interface every GPU source implements, and what it returns.

A reading describes devices with the API models (Gpu, MigDevice) but keeps their processes
apart, as plain tuples: a node can run hundreds of GPU processes, the agent reads them every
cycle, and most cycles publish nothing. A validated model per process cost more than reading
NVML itself, so the validated Process is built only for a write (report.build_spec), after the
resolver has filled in containers and pods, the same way for every source.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from gpuusage.api.models import Gpu, MigDevice, ProcessType, Source
from gpuusage_nodeagent.gpusource.sampling import SampleBatch


class RawProcess(NamedTuple):
    """One process as the GPU library reported it on one device, not yet attributed.

    Field names match the API's Process, whose validation it meets by construction (sources
    bound every value), so the two are interchangeable wherever only these fields are read.
    """

    pid: int
    name: str | None
    used_memory_mib: int | None
    types: tuple[ProcessType, ...]
    sm_util_percent: int | None = None
    memory_util_percent: int | None = None
    active: bool | None = None
    """Whether a sample showed the process at work on any of the device's engines since the
    last reading: True, False (the device's sampler was read and named it at work in none of
    its samples, which on a shared GPU does not yet mean it was idle: see activity), None (not
    known: MIG devices, GPUs without per-process utilization, a failed read, MPS clients)."""


NO_PROCESSES: tuple[RawProcess, ...] = ()


def activity(types: tuple[ProcessType, ...], busy: bool | None) -> bool | None:
    """A process's `active`, from whether its samples showed work (None: the device reports
    no per-process utilization). Without work: inactive, except for an MPS client, whose
    work the driver samples under the MPS server's pid, so its own quiet says nothing."""
    if busy is None:
        return None
    if busy:
        return True
    return None if "mps" in types else False


@dataclass(frozen=True)
class Reading:
    """One observation of the node's GPUs.

    `gpus` carry no processes (their `processes` lists are empty); `processes` lists them per
    device UUID, GPU or MIG device alike (UUIDs are unique on a node).
    """

    source: Source
    gpus: list[Gpu]
    errors: Counter[str] = field(default_factory=Counter)
    """GPU library errors during this reading, by kind (e.g. GpuIsLost), for metrics."""
    processes: Mapping[str, Sequence[RawProcess]] = field(default_factory=dict)
    samples: Mapping[str, Sequence[SampleBatch]] = field(default_factory=dict)
    """The reads of each device's utilization sampler since the last reading, by device UUID;
    absent for a device whose sampler was not read (see activity)."""
    share_samples: Mapping[str, Sequence[SampleBatch]] = field(default_factory=dict)
    """The short reads made for the compute share since the last reading (see share), by
    device UUID."""

    def processes_of(self, device: Gpu | MigDevice) -> Sequence[RawProcess]:
        """The processes the reading lists on `device` (none for a device without a UUID:
        it failed before anything could be read)."""
        if device.uuid is None:
            return NO_PROCESSES
        return self.processes.get(device.uuid, NO_PROCESSES)

    def all_processes(self) -> list[RawProcess]:
        """Every process of the reading, on GPUs and MIG devices."""
        return [p for listed in self.processes.values() for p in listed]


class GpuSource(Protocol):
    """Reads the node's GPUs. Must not raise for a broken GPU or a missing library: it reports
    them in the reading instead, so one bad device never hides the others."""

    def read(self) -> Reading: ...

    def poll(self) -> None:
        """Read the devices' utilization samplers between two readings (the driver keeps only
        its last 72 samples); the next reading hands them over. Must not raise."""

    def sample_shares(self, devices: Collection[str], span: float) -> None:
        """Read the last `span` seconds of the samplers of `devices`, for their processes'
        shares (see share), without moving the cursor of the reads above; the next reading
        hands them over. Must not raise."""

    def close(self) -> None: ...


def error_reason(exc: BaseException) -> str:
    """NVML's error class name without its prefix: NVMLError_GpuIsLost → GpuIsLost."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name.removeprefix("NVMLError_")
    return "Unknown" if name == "NVMLError" else name
