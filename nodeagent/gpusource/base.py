"""The interface every GPU source implements, and what it returns.

A reading uses the API models directly (Gpu, MigDevice, Process) with attribution left empty:
the resolver fills in containers and pods afterwards, the same way for every source.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from gpuusage.api.models import Gpu, Source


@dataclass(frozen=True)
class Reading:
    """One observation of the node's GPUs."""

    source: Source
    gpus: list[Gpu]
    errors: Counter[str] = field(default_factory=Counter)
    """GPU library errors during this reading, by kind (e.g. GpuIsLost), for metrics."""


class GpuSource(Protocol):
    """Reads the node's GPUs. Must not raise for a broken GPU or a missing library: it reports
    them in the reading instead, so one bad device never hides the others."""

    def read(self) -> Reading: ...

    def close(self) -> None: ...


def error_reason(exc: BaseException) -> str:
    """NVML's error class name without its prefix: NVMLError_GpuIsLost → GpuIsLost."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name.removeprefix("NVMLError_")
    return "Unknown" if name == "NVMLError" else name
