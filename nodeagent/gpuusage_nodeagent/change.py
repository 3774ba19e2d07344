"""When is a new observation worth a write? Pure.

The rule, chosen so that a steady node costs one write per heartbeat and nothing in between:

* Any change in *what* is on the node is meaningful: GPUs and MIG devices, their errors, the
  set of processes, any process's container, pod, name or types, the source (driver, NVML
  availability).
* Memory is meaningful only when it moved by at least `memory_threshold_mib` compared with the
  *last published* report (not the last observation), per process and per device. A process
  that grows slowly therefore still gets published once the drift adds up, while allocator
  jitter of a few MiB never causes a write.
* A process's compute share (see share) is meaningful only when it came or went, or moved since
  it was last published by more than the estimates' own noise (SHARE_Z standard errors of the
  difference of two shares, see share_noise) and by at least `share_threshold`: the sampler's
  noise, which grows as the share window shrinks, never causes a write.
* Utilization percentages are never a reason to write by themselves: they change every second.
  They are refreshed with every write, and at least once per heartbeat.
* The heartbeat (a write even without change) keeps `observedAt` fresh, which is how the
  operator tells a live agent from a dead one.

What a process contributes (its attributed identity) is decided by report.attribution, the
same function that fills the published process, so the two can never disagree.

A spec is reduced once to a fingerprint, (everything compared exactly, memory values in a fixed
order), so the comparison is two tuple walks instead of a diff of nested documents: the agent
makes this decision every cycle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from gpuusage.api.models import Gpu, Memory, MigDevice, Source
from gpuusage.api.summary import share_moved

Exact = tuple[Any, ...]
Memories = tuple[int | None, ...]
Shared = tuple[float, int]
"""A share as published, with the sampler instants it rests on."""
Shares = tuple[Shared | None, ...]
DEFAULT_SHARE_THRESHOLD = 0.05
SHARE_Z = 3.0
"""Standard errors a share must move by to be news (benchmarks/README.md, "Compute shares a
steady node republishes": on the driver model, no steady tenant's share republished in an hour
at 60 to 300 s windows, and at 30 s in all but one run of eight)."""
INDEPENDENT_PER_ROOT = 5.0
"""A share resting on n sampler instants varies as one of about 5 √n independent ones (n where
that is fewer): an engine slice spans several instants, so they are not independent (measured
on the driver model at 30 to 300 s windows: n = 44 to 450, as 32 to 115)."""


@dataclass(frozen=True)
class Fingerprint:
    """What the rule compares: the exact part and the memory values, in matching order."""

    exact: Exact
    memories: Memories
    shares: Shares = ()


@dataclass(frozen=True)
class Decision:
    write: bool
    reason: str


class Measured(Protocol):
    """What the rule reads of any process: its pid and its memory."""

    @property
    def pid(self) -> int: ...

    @property
    def used_memory_mib(self) -> int | None: ...


P = TypeVar("P", bound=Measured)


def _memory_key(m: Memory | None) -> Exact:
    return (None,) if m is None else (m.total_mib,)


def fingerprint(
    node_name: str,
    source: Source | None,
    gpus: Iterable[Gpu],
    processes_of: Callable[[Gpu | MigDevice], Sequence[P]],
    key: Callable[[Gpu | MigDevice, P], Exact],
    *,
    share_of: Callable[[Gpu | MigDevice, P], Shared | None] | None = None,
) -> Fingerprint:
    """The fingerprint of a report's devices: `processes_of` lists a device's processes and
    `key` gives each one's attributed identity (report.AttributedReading passes the same rule
    the published spec is built by, so a cycle that writes nothing never builds the spec)."""
    exact: list[Any] = [node_name, source]
    memories: list[int | None] = []
    shares: list[Shared | None] = []

    def device(kind: str, d: Gpu | MigDevice) -> int:
        processes = processes_of(d)
        exact.append(
            (kind, d.index, d.uuid, d.name, d.error, d.omitted_processes, *_memory_key(d.memory))
        )
        memories.append(d.memory.used_mib if d.memory is not None else None)
        memories.append(d.omitted_memory_mib)
        exact.extend(key(d, p) for p in processes)
        memories.extend(p.used_memory_mib for p in processes)
        if share_of is not None:
            shares.extend(share_of(d, p) for p in processes)
        return len(processes)

    for gpu in gpus:
        listed = device("gpu", gpu)
        exact.append((gpu.pci_bus_id, gpu.mig_enabled, listed, len(gpu.mig_devices)))
        for mig in gpu.mig_devices:
            listed = device("mig", mig)
            exact.append((mig.gpu_instance_id, mig.compute_instance_id, listed))
    return Fingerprint(tuple(exact), tuple(memories), tuple(shares))


def _moved(old: Memories, new: Memories, threshold: int) -> bool:
    for a, b in zip(old, new, strict=True):
        if a is None or b is None:
            if a is not b:
                return True
        elif abs(a - b) >= threshold:
            return True
    return False


def share_noise(old: Shared, new: Shared) -> float:
    """The standard error of the difference of two shares, each a proportion of the
    independent instants its sampler instants stand for (INDEPENDENT_PER_ROOT); 0 where an
    estimate rests on none (no precision known: the threshold alone)."""
    (a, n), (b, m) = old, new
    if n <= 0 or m <= 0:
        return 0.0
    n_eff, m_eff = (min(k, INDEPENDENT_PER_ROOT * math.sqrt(k)) for k in (n, m))
    return math.sqrt(a * (1 - a) / n_eff + b * (1 - b) / m_eff)


def shares_moved(old: Shares, new: Shares, threshold: float = DEFAULT_SHARE_THRESHOLD) -> bool:
    """Whether a share came, went, or moved by more than its noise and the threshold."""
    if len(old) != len(new):
        return True
    for a, b in zip(old, new, strict=True):
        if a is None or b is None:
            if a is not b:
                return True
        elif share_moved(a[0], b[0], max(threshold, SHARE_Z * share_noise(a, b))):
            return True
    return False


def meaningful_change(
    old: Fingerprint,
    new: Fingerprint,
    threshold_mib: int,
    share_threshold: float = DEFAULT_SHARE_THRESHOLD,
) -> bool:
    """True when new differs from old by more than volatile fields, memory jitter and the
    sampler's noise in the shares."""
    if old.exact != new.exact or len(old.memories) != len(new.memories):
        return True
    if _moved(old.memories, new.memories, threshold_mib):
        return True
    return shares_moved(old.shares, new.shares, share_threshold)


def decide(
    published: Fingerprint | None,
    published_at: datetime | None,
    new: Fingerprint,
    now: datetime,
    *,
    heartbeat: timedelta,
    threshold_mib: int,
    share_threshold: float = DEFAULT_SHARE_THRESHOLD,
) -> Decision:
    """Whether to write the report fingerprinted as `new`, given the last published one."""
    if published is None or published_at is None:
        return Decision(True, "first report")
    if meaningful_change(published, new, threshold_mib, share_threshold):
        return Decision(True, "changed")
    if now - published_at >= heartbeat:
        return Decision(True, "heartbeat")
    return Decision(False, "unchanged")
