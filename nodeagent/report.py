"""Build the GpuNodeUsage spec from a reading and the pids' attributions. Pure.

Kept apart from I/O so that every attribution rule (name fallback, unresolvable pids) is tested
without a proc tree, and so that the benchmark measures the real code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Process
from gpuusage.nodeagent.change import Exact, Fingerprint, ProcessKey, devices_fingerprint, own_key
from gpuusage.nodeagent.gpusource.base import Reading
from gpuusage.nodeagent.resolver import Resolved


def reading_pids(reading: Reading) -> set[int]:
    """Every pid the reading lists, on GPUs and MIG devices."""
    return {p.pid for p in reading_processes(reading)}


def _attribution(process: Process, resolved: Resolved) -> dict[str, str | None]:
    """The fields the resolver decides: one rule for the spec and for the write rule's key."""
    return {
        "container_id": resolved.attribution.container_id,
        "pod_uid": resolved.attribution.pod_uid,
        "name": process.name or resolved.comm,
        "resolve_error": resolved.error,
    }


def attribute(process: Process, resolved: Resolved | None) -> Process:
    """A process with its container, pod and name filled in from what the proc root said."""
    if resolved is None:
        return process
    return process.model_copy(update=_attribution(process, resolved))


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


def attributed_key(found: Mapping[int, Resolved]) -> ProcessKey:
    """own_key of attribute(process, found[pid]), without building the attributed process."""

    def key(p: Process) -> Exact:
        r = found.get(p.pid)
        if r is None:
            return own_key(p)
        f = _attribution(p, r)
        return (p.pid, f["name"], f["container_id"], f["pod_uid"], tuple(p.types),
                f["resolve_error"])  # fmt: skip

    return key


def reading_processes(reading: Reading) -> Iterator[Process]:
    for gpu in reading.gpus:
        yield from gpu.processes
        for mig in gpu.mig_devices:
            yield from mig.processes


@dataclass
class Observation:
    """One cycle's reading with its attributions; the spec is built only when asked for.

    Most cycles publish nothing (the write rule needs only the fingerprint), and building the
    spec, a validated model per process, was the largest cost of a cycle at hundreds of
    processes.
    """

    node_name: str
    observed_at: datetime
    reading: Reading
    found: Mapping[int, Resolved]
    _spec: GpuNodeUsageSpec | None = field(default=None, repr=False)

    def spec(self) -> GpuNodeUsageSpec:
        if self._spec is None:
            self._spec = build_spec(self.node_name, self.observed_at, self.reading, self.found)
        return self._spec

    def fingerprint(self) -> Fingerprint:
        return devices_fingerprint(
            self.node_name, self.reading.source, self.reading.gpus, attributed_key(self.found)
        )

    def unresolved(self) -> int:
        """Processes the resolver could not attribute (for the agent's metrics)."""
        return sum(1 for p in reading_processes(self.reading)
                   if (r := self.found.get(p.pid)) is not None and r.error)  # fmt: skip
