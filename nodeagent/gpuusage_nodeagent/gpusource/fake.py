"""A GPU source that reads a scenario file: the demo, tests and benchmarks use it.

The format is DESIGN.md's, extended: MIG devices, utilization, per-process names and types,
and injected NVML errors (on the library, on a GPU, on its process list). The file is read on
every reading, so editing it changes what the agent reports, as a process starting or ending
would. A file that becomes invalid is reported in the log and in the published object while the
last good reading is kept, so a typo loses nothing. Invalid means anything the agent could not
report faithfully: not UTF-8, not YAML, empty (an empty file would say "no GPUs" and end every
pod's use; a node without GPUs is written `gpus: []`), a value beyond the API's bounds, or a
GPU UUID, MIG UUID, index or pid listed twice (which would be counted twice).
"""

from __future__ import annotations

import logging
from collections import Counter
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
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading, activity, any_engine

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
    """Per-process utilization of the SMs, memory controller, encoder and decoder; all absent:
    the device reports none for it."""


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
    """Defaults to the sum of the processes' memory; more than they hold emulates processes
    NVML does not list."""
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
    """Defaults to the sum of the processes' memory (and the reserved part); more than they
    hold emulates processes NVML does not list."""
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


def _processes(procs: list[FakeProcess], with_utilization: bool) -> list[RawProcess]:
    found = []
    for proc in procs:
        types = tuple(dict.fromkeys(proc.types))
        engines = (proc.smUtil, proc.memUtil, proc.encUtil, proc.decUtil)
        sampled = with_utilization and any(e is not None for e in engines)
        found.append(
            RawProcess(
                pid=proc.pid,
                name=proc.name,
                used_memory_mib=proc.usedMemoryMiB,
                types=types,
                sm_util_percent=proc.smUtil if with_utilization else None,
                memory_util_percent=proc.memUtil if with_utilization else None,
                active=activity(types, any_engine(*engines) if sampled else None),
            )
        )
    return found


def _or(given: int | None, default: int) -> int:
    return default if given is None else given


def _used(procs: list[FakeProcess]) -> int:
    return sum(p.usedMemoryMiB or 0 for p in procs)


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
                processes[m.uuid] = _processes(m.processes, with_utilization=False)
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
            processes[spec.uuid] = _processes(spec.processes, with_utilization=True)
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


class FakeSource:
    """GpuSource over a scenario file, re-read on every reading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last_good: Scenario = load_scenario(path)  # fail fast on a bad file at start
        built(self._last_good, path)
        self._last_error: str | None = None

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
        if scenario.nvmlError:  # the library fails: no GPU was read, so none of their errors
            errors = Counter([scenario.nvmlError, *(["ScenarioInvalid"] if note else [])])
            source = Source(
                kind="fake",
                available=False,
                message=f"NVML unavailable ({scenario.nvmlError}); idling, will retry",
                agent_version=__version__,
            )
            return Reading(source, [], errors)
        source = Source(
            kind="fake",
            available=True,
            message=note,
            driver_version=scenario.driverVersion,
            cuda_version=scenario.cudaVersion,
            agent_version=__version__,
        )
        return Reading(source, gpus, errors, processes)

    def close(self) -> None:
        """Nothing to release."""
