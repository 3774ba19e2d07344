"""A GPU source that reads a scenario file: the demo, tests and benchmarks use it.

The format (docs/agent.md) lists GPUs and processes as the report does, with MIG devices,
utilization, per-process names and types, and injected NVML errors (on the library, on a GPU, on
its process list). It behaves as the real driver was measured to (see drivermodel): a device's
memory in use includes the driver's bookkeeping per process unless the file gives it, and a
process's utilization is what the driver's sampler shows of it: one process per sample, about 5
samples a second, so that on a GPU several busy processes share, a busy one can go unsampled for
a while. The file is read on every reading, so editing it changes what the agent reports, as a
process starting or ending would. A file that becomes invalid is reported in the log and in the
published object while the last good reading is kept, so a typo loses nothing. Invalid means
anything the agent could not report faithfully: not UTF-8, not YAML, empty (an empty file would
say "no GPUs" and end every pod's use; a node without GPUs is written `gpus: []`), a value
beyond the API's bounds, or a GPU UUID, MIG UUID, index or pid listed twice (which would be
counted twice).

Like NVML from nvmlInit to nvmlShutdown, it holds the driver's device files open while the
library works: where a folder `dev` lies beside the scenario file, its `nvidiactl` and the
`nvidia<minor>` of each GPU with a `minorNumber` (files the caller makes) are opened at a reading
whose scenario has no `nvmlError`, and closed by `close` or a reading with one. Whether the agent
lets go of the driver can then be checked in its /proc/<pid>/fd, as on a GPU node.

Like the NVML library a container is given, its library is of one driver version: the file's
`driverVersion` when the source was made. A later scenario with another `driverVersion` (a
driver replaced by another version) reads as nvmlInit then fails on the real driver:
LibRmVersionMismatch, no GPU, no device file held, for as long as the scenario says so; a new
source (a new agent process, as a new container is given the new driver's library) reads it.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuusage import __version__
from gpuusage.api.models import (
    GPU_UUID_PATTERN,
    MAX_GPUS,
    MAX_MIB,
    MAX_MIG_DEVICES,
    MAX_PID,
    MIG_UUID_PATTERN,
    SAFE_TEXT_PATTERN,
    DeviceError,
    Gpu,
    Memory,
    MigDevice,
    ProcessType,
    ProductName,
    Source,
    Utilization,
    safe_text,
)
from gpuusage.errors import GpuusageError
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading, activity
from gpuusage_nodeagent.gpusource.drivermodel import (
    MPS_SERVER,
    Sampler,
    Work,
    bookkeeping_mib,
    under_mps_server,
    work_of,
)
from gpuusage_nodeagent.gpusource.sampling import (
    Latest,
    SampleBatch,
    SampleCursor,
    share_batch,
    share_since,
)

log = logging.getLogger(__name__)

NvmlErrorName = Literal[
    "GpuIsLost",
    "NoPermission",
    "NotSupported",
    "Unknown",
    "LibraryNotFound",
    "DriverNotLoaded",
    "LibRmVersionMismatch",
    "FunctionNotFound",
]


MAX_SCENARIO_PROCESSES = 8 * MAX_GPUS * 64
"""More than a report may list (a busy node): the agent keeps the largest (see caps)."""


class ScenarioError(GpuusageError):
    """The scenario file cannot be read or is invalid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _once(what: str, values: list[Any]) -> None:
    """Refuse a list in which a key appears twice: it would be counted twice."""
    twice = sorted(str(value) for value, n in Counter(values).items() if n > 1)
    if twice:
        raise ValueError(f"{what} listed more than once: {', '.join(twice)}")


class FakeProcess(_Strict):
    pid: Annotated[int, Field(ge=1, le=MAX_PID)]
    usedMemoryMiB: Annotated[int, Field(ge=0, le=MAX_MIB)] | None = None
    name: Annotated[str, Field(max_length=64)] | None = None
    types: list[ProcessType] = Field(default_factory=lambda: list[ProcessType](["compute"]))
    smUtil: Annotated[int, Field(ge=0, le=100)] | None = None
    memUtil: Annotated[int, Field(ge=0, le=100)] | None = None
    encUtil: Annotated[int, Field(ge=0, le=100)] | None = None
    decUtil: Annotated[int, Field(ge=0, le=100)] | None = None
    """What a sample of the process shows on the SMs, memory controller, encoder and decoder:
    any above 0 makes it busy (sampled when its turn comes, see drivermodel); all 0: idle (never
    sampled); all absent: the device reports no utilization for it."""
    duty: Annotated[float, Field(ge=0, le=1, strict=True)] | None = None
    """The share of the time it has work for the engines, as if it ran alone (the first `duty`
    of each period of about a second; see drivermodel); absent: 1 when its values above show
    work, else 0."""

    def told(self) -> bool:
        return any(e is not None for e in (self.smUtil, self.memUtil, self.encUtil, self.decUtil))

    @model_validator(mode="after")
    def _duty_with_work(self) -> FakeProcess:
        shows = any((self.smUtil, self.memUtil, self.encUtil, self.decUtil))
        if self.duty and not shows:
            raise ValueError(
                f"pid {self.pid}: duty {self.duty} needs smUtil, memUtil, encUtil or decUtil "
                "above 0 (what its samples show while it works)"
            )
        return self


class FakeUtilization(_Strict):
    gpu: Annotated[int, Field(ge=0, le=100)] | None = None
    memory: Annotated[int, Field(ge=0, le=100)] | None = None


class FakeMig(_Strict):
    index: Annotated[int, Field(ge=0, le=MAX_MIG_DEVICES)]
    uuid: Annotated[str, Field(pattern=MIG_UUID_PATTERN)]
    name: ProductName | None = None
    gpuInstanceId: int | None = None
    computeInstanceId: int | None = None
    memoryTotalMiB: Annotated[int, Field(ge=0, le=MAX_MIB)] | None = None
    memoryUsedMiB: Annotated[int, Field(ge=0, le=MAX_MIB)] | None = None
    """Defaults to the sum of the processes' memory and the driver's bookkeeping for them; more
    than that emulates processes NVML does not list."""
    processes: Annotated[list[FakeProcess], Field(max_length=MAX_SCENARIO_PROCESSES)] = Field(
        default_factory=list
    )

    @model_validator(mode="after")
    def _pids_once(self) -> FakeMig:
        _once(f"pid on {self.uuid}", [p.pid for p in self.processes])
        return self


class FakeGpu(_Strict):
    index: Annotated[int, Field(ge=0, le=MAX_GPUS)]
    uuid: Annotated[str, Field(pattern=GPU_UUID_PATTERN)]
    name: ProductName | None = None
    memoryTotalMiB: Annotated[int, Field(ge=0, le=MAX_MIB)]
    memoryUsedMiB: Annotated[int, Field(ge=0, le=MAX_MIB)] | None = None
    """Defaults to the sum of the processes' memory, the driver's bookkeeping for them and the
    reserved part; more than that emulates processes NVML does not list."""
    minorNumber: Annotated[int, Field(ge=0, le=254)] | None = None
    """The device node's minor number (/dev/nvidia<minor>)."""
    memoryReservedMiB: Annotated[int, Field(ge=0, le=MAX_MIB)] | None = None
    """The driver's reserved part, as NVML's memory info v2 tells it; absent: not told."""
    utilization: FakeUtilization | None = None
    error: NvmlErrorName | None = None
    """The whole GPU fails with this NVML error (e.g. GpuIsLost)."""
    processesError: NvmlErrorName | None = None
    """Reading this GPU's processes fails with this NVML error."""
    processes: Annotated[list[FakeProcess], Field(max_length=MAX_SCENARIO_PROCESSES)] = Field(
        default_factory=list
    )
    migDevices: Annotated[list[FakeMig], Field(max_length=MAX_MIG_DEVICES)] | None = None
    """When present, MIG mode is on and processes belong to the MIG devices."""

    @model_validator(mode="after")
    def _listed_once(self) -> FakeGpu:
        _once(f"pid on {self.uuid}", [p.pid for p in self.processes])
        _once(f"MIG index on {self.uuid}", [m.index for m in self.migDevices or []])
        return self


Version = Annotated[str, Field(min_length=1, max_length=64, pattern=SAFE_TEXT_PATTERN)]


class Scenario(_Strict):
    """A fake node: what NVML would report."""

    driverVersion: Version = "550.54.15"
    cudaVersion: Version | None = "12.4"
    nvmlError: NvmlErrorName | None = None
    """The library itself fails with this error: the node has no usable NVML."""
    gpus: Annotated[list[FakeGpu], Field(max_length=MAX_GPUS)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _devices_once(self) -> Scenario:
        _once("GPU index", [g.index for g in self.gpus])
        migs = [m.uuid for g in self.gpus for m in g.migDevices or []]
        _once("device UUID", [g.uuid for g in self.gpus] + migs)
        return self


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors()
    )


def load_scenario(path: Path) -> Scenario:
    """Parse a scenario file; errors name the file and the offending field."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"cannot read GPU scenario {path}: {exc.strerror}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(
            f"GPU scenario {path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"GPU scenario {path} is not valid YAML: {exc}") from exc
    if raw is None:
        raise ScenarioError(
            f"GPU scenario {path} is empty; a node without GPUs is written `gpus: []`"
        )
    if not isinstance(raw, dict):
        raise ScenarioError(
            f"GPU scenario {path} must be a mapping with `gpus:`, not {type(raw).__name__}"
        )
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(f"GPU scenario {path} is invalid: {_problems(exc)}") from exc


Built = tuple[list[Gpu], Counter[str], dict[str, list[RawProcess]]]
"""What a reading holds of a scenario: GPUs, errors by kind, processes by device UUID."""


def built(scenario: Scenario, path: Path) -> Built:
    """The reading's parts for a scenario; ScenarioError when what they describe is beyond the
    API's bounds (the file is then as invalid as a file with a bad field)."""
    errors: Counter[str] = Counter()
    processes: dict[str, list[RawProcess]] = {}
    try:
        return scenario_gpus(scenario, errors, processes), errors, processes
    except ValidationError as exc:
        raise ScenarioError(f"GPU scenario {path} is invalid: {_problems(exc)}") from exc


def _processes(procs: list[FakeProcess]) -> list[RawProcess]:
    """The processes as listed, their utilization not read yet (see FakeSource._sampled)."""
    return [
        RawProcess(
            pid=proc.pid,
            name=proc.name,
            used_memory_mib=proc.usedMemoryMiB,
            types=tuple(dict.fromkeys(proc.types)),
        )
        for proc in procs
    ]


def _or(given: int | None, default: int) -> int:
    return default if given is None else given


def _used(procs: list[FakeProcess]) -> int:
    """What a device's processes hold, with what the driver keeps for their contexts."""
    return sum(p.usedMemoryMiB or 0 for p in procs) + bookkeeping_mib(len(procs))


def scenario_gpus(
    scenario: Scenario, errors: Counter[str], processes: dict[str, list[RawProcess]]
) -> list[Gpu]:
    """The GPUs a scenario describes, as NvmlSource would report them; their processes, and
    their MIG devices', go into `processes` by device UUID."""
    gpus = []
    for spec in scenario.gpus:
        if spec.error:
            errors[spec.error] += 1
            gpus.append(
                Gpu(
                    index=spec.index,
                    uuid=spec.uuid,
                    error=DeviceError(reason=spec.error, message=f"reading GPU: {spec.error}"),
                )
            )
            continue
        error = None
        migs: list[MigDevice] = []
        if spec.processesError and spec.processesError != "NotSupported":
            errors[spec.processesError] += 1
            error = DeviceError(
                reason=spec.processesError, message=f"reading processes: {spec.processesError}"
            )
        elif spec.migDevices is not None:
            for m in spec.migDevices:
                processes[m.uuid] = _processes(m.processes)
            migs = [
                MigDevice(
                    index=m.index,
                    uuid=m.uuid,
                    name=m.name,
                    gpu_instance_id=m.gpuInstanceId,
                    compute_instance_id=m.computeInstanceId,
                    memory=(
                        Memory(
                            total_mib=m.memoryTotalMiB,
                            used_mib=min(
                                _or(m.memoryUsedMiB, _used(m.processes)), m.memoryTotalMiB
                            ),
                        )
                        if m.memoryTotalMiB is not None
                        else None
                    ),
                )
                for m in spec.migDevices
            ]
        elif not spec.processesError:
            processes[spec.uuid] = _processes(spec.processes)
        used = spec.memoryUsedMiB
        if used is None:
            used = (spec.memoryReservedMiB or 0) + _used(spec.processes)
            used += sum(_or(m.memoryUsedMiB, _used(m.processes)) for m in spec.migDevices or [])
        gpus.append(
            Gpu(
                index=spec.index,
                uuid=spec.uuid,
                name=spec.name,
                minor_number=spec.minorNumber,
                memory=Memory(
                    total_mib=spec.memoryTotalMiB,
                    used_mib=min(used, spec.memoryTotalMiB),
                    reserved_mib=(
                        None
                        if spec.memoryReservedMiB is None
                        else min(spec.memoryReservedMiB, used, spec.memoryTotalMiB)
                    ),
                ),
                utilization=(
                    Utilization(
                        gpu_percent=spec.utilization.gpu, memory_percent=spec.utilization.memory
                    )
                    if spec.utilization
                    else None
                ),
                mig_enabled=spec.migDevices is not None,
                mig_devices=migs,
                error=error,
            )
        )
    return gpus


def sampled_work(spec: FakeGpu) -> dict[int, Work] | None:
    """What the sampler of a GPU sees its processes do; None where it reports nothing (MIG,
    a failed process list, no process told)."""
    if spec.migDevices is not None or spec.processesError or spec.error:
        return None
    told = [p for p in spec.processes if p.told()]
    if not told:
        return None
    work = {p.pid: _work(p) for p in told}
    clients = [p.pid for p in told if "mps" in p.types]
    server = next((p.pid for p in spec.processes if p.name == MPS_SERVER), None)
    return under_mps_server(work, clients, server)


def _work(process: FakeProcess) -> Work:
    """What a told process does on the engines: its values, for its duty of the time."""
    work = work_of(process.smUtil, process.memUtil, process.encUtil, process.decUtil)
    if process.duty is None or not work.duty:
        return work
    return Work(process.duty, work.sm, work.mem, work.enc, work.dec)


def _with_samples(process: RawProcess, latest: Latest) -> RawProcess:
    """A told process with what the samples since the last reading showed of it."""
    sm, mem, busy = latest.get(process.pid, (None, None, False))
    return process._replace(
        sm_util_percent=sm, memory_util_percent=mem, active=activity(process.types, busy)
    )


class FakeSource:
    """GpuSource over a scenario file, re-read on every reading, with the driver's sampler
    model per GPU (see drivermodel) on the injected clock."""

    def __init__(
        self, path: Path, clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    ) -> None:
        self.path = path
        self.clock = clock
        self._last_good: Scenario = load_scenario(path)  # fail fast on a bad file at start
        built(self._last_good, path)
        self._last_error: str | None = None
        self._samplers: dict[str, tuple[Sampler, SampleCursor]] = {}
        self._share_batches: dict[str, list[SampleBatch]] = {}
        self._share_read: dict[str, datetime] = {}
        self._held: dict[str, int] = {}  # the device files held open, by name
        self.library = self._last_good.driverVersion
        """The driver version of the emulated NVML library (see the module docstring)."""

    def _hold(self, scenario: Scenario) -> None:
        """Hold open the scenario's device files found in the folder `dev` beside it."""
        folder = self.path.parent / "dev"
        minors = [g.minorNumber for g in scenario.gpus if g.minorNumber is not None]
        for name in ["nvidiactl", *(f"nvidia{minor}" for minor in minors)]:
            if name in self._held:
                continue
            try:
                self._held[name] = os.open(folder / name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # no such device file: nothing to hold

    def poll(self) -> None:
        """Read each GPU's sampler as the last valid scenario has its processes working."""
        now = self.clock()
        for spec in self._last_good.gpus:
            work = sampled_work(spec)
            if work is not None:
                self._sample(spec.uuid, work, now)

    def sample_shares(self, devices: Collection[str], span: float) -> None:
        """Read the last `span` seconds of the samplers of `devices` (see share)."""
        now = self.clock()
        now_us = int(now.timestamp() * 1_000_000)
        for spec in self._last_good.gpus:
            found = self._samplers.get(spec.uuid)
            work = sampled_work(spec) if spec.uuid in devices else None
            if found is None or work is None:
                continue
            found[0].advance(now_us, work)
            since = share_since(now, span, self._share_read.get(spec.uuid))
            samples = found[0].read(int(since.timestamp() * 1_000_000))
            self._share_read[spec.uuid] = now
            batch = share_batch(samples, now, (now - since).total_seconds())
            self._share_batches.setdefault(spec.uuid, []).append(batch)

    def sampler(self, uuid: str) -> Sampler | None:
        """The driver model's sampler of a GPU (its tally is the truth a share is measured
        against); None before its first read."""
        found = self._samplers.get(uuid)
        return None if found is None else found[0]

    def _sample(self, uuid: str, work: dict[int, Work], now: datetime) -> SampleCursor:
        sampler, cursor = self._samplers.get(uuid) or (Sampler(uuid, history=True), SampleCursor())
        self._samplers[uuid] = (sampler, cursor)
        sampler.advance(int(now.timestamp() * 1_000_000), work)
        cursor.take(sampler.read(cursor.since_us), now)
        return cursor

    def _sampled(
        self, scenario: Scenario, processes: dict[str, list[RawProcess]]
    ) -> tuple[dict[str, list[SampleBatch]], dict[str, int]]:
        """Each GPU's processes with what its sampler showed since the last reading; the
        batches of reads, and the device's utilization meter now, by UUID."""
        now = self.clock()
        batches: dict[str, list[SampleBatch]] = {}
        meters: dict[str, int] = {}
        for spec in scenario.gpus:
            work = sampled_work(spec)
            if work is None or spec.uuid not in processes:
                self._samplers.pop(spec.uuid, None)
                continue
            found, latest = self._sample(spec.uuid, work, now).drain()
            batches[spec.uuid] = found
            meter = self._samplers[spec.uuid][0].busy_percent()
            if meter is not None:
                meters[spec.uuid] = meter
            told = work.keys() | {p.pid for p in spec.processes if p.told()}
            processes[spec.uuid] = [
                _with_samples(p, latest) if p.pid in told else p for p in processes[spec.uuid]
            ]
        return batches, meters

    def read(self) -> Reading:
        note = None
        try:
            scenario = load_scenario(self.path)
            gpus, errors, processes = built(scenario, self.path)
            self._last_good, self._last_error = scenario, None
        except ScenarioError as exc:
            if str(exc) != self._last_error:
                log.error("%s; keeping the last valid scenario", exc)
            self._last_error = str(exc)
            scenario = self._last_good
            gpus, errors, processes = built(scenario, self.path)  # valid: it was before
            note = safe_text(f"{exc}", 900) + "; showing the last valid scenario"
            errors["ScenarioInvalid"] += 1
        failure = scenario.nvmlError
        if failure is None and scenario.driverVersion != self.library:
            failure = "LibRmVersionMismatch"  # the kernel refuses a library of another version
        if failure:  # the library fails: no GPU was read, so none of their errors
            self.close()
            errors = Counter([failure, *(["ScenarioInvalid"] if note else [])])
            source = Source(
                kind="fake",
                available=False,
                message=f"NVML unavailable ({failure}); idling, will retry",
                agent_version=__version__,
            )
            return Reading(source, [], errors)
        self._hold(scenario)
        source = Source(
            kind="fake",
            available=True,
            message=note,
            driver_version=scenario.driverVersion,
            cuda_version=scenario.cudaVersion,
            agent_version=__version__,
        )
        samples, meters = self._sampled(scenario, processes)
        shares, self._share_batches = self._share_batches, {}
        given = {spec.uuid for spec in scenario.gpus if spec.utilization is not None}
        gpus = [
            gpu.model_copy(update={"utilization": Utilization(gpu_percent=meters[gpu.uuid])})
            if gpu.uuid in meters and gpu.uuid not in given
            else gpu
            for gpu in gpus
        ]
        return Reading(source, gpus, errors, processes, samples, shares)

    def close(self) -> None:
        """Close the device files held (see the module docstring)."""
        held, self._held = self._held, {}
        for fd in held.values():
            os.close(fd)
