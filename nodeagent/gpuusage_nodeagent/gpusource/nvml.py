"""The real GPU source: NVML through pynvml (package nvidia-ml-py).

Policies, each from an observed failure mode:

* A node without a usable NVML (library missing, driver not loaded, library/driver mismatch)
  idles and says so in the report instead of crash-looping; initialisation is retried on
  later readings, so a driver installed after the agent started is picked up (a mismatch of
  library and module that lasts is the agent's end, in time: see gpusource.replaced). A driver that
  goes away under an initialised session (counting the GPUs, or a GPU, fails with
  DriverNotLoaded, Uninitialized or LibRmVersionMismatch) has NVML shut down at once, so no
  handle or device file of the agent keeps it loaded.
* One failing GPU (lost, no permission, not supported) is reported on that GPU with the
  reason; the other GPUs are read as usual. A GPU whose UUID was read before keeps it.
* Compute, graphics and MPS-client process lists are merged by pid. Each list is read through
  the first call of this order that the driver has and that gives a list that can be true:
  `nvmlDeviceGetRunningProcessDetailList` (a versioned struct, so a driver and bindings that
  disagree on its layout say so instead of misreading it; R550+), the `_v3` call (R510+), the
  `_v2` call. Drivers 535.43-535.86 grew the v3 struct without a new version: read with the
  bindings' layout, the list holds pids of 0 or 0xFFFFFFFF and loses its end. So a list with an
  impossible pid is never used: the next call of the order is tried (and kept once it reads
  true), and when none reads true the device is reported as one whose processes cannot be
  read (`InvalidProcessList`), never as a device without processes.
* Memory is read before and after the process lists and the lower figure is reported, so a
  process starting or ending between the reads does not look like memory no listed process
  explains (see visibility). `reservedMiB` comes from the versioned memory call (R510+).
* MIG: processes are queried per MIG device handle; the parent handle only gives aggregates.
  Per-process utilization does not exist on MIG devices.
* Process-utilization samples are read incrementally (from the last seen timestamp), at each
  reading and between readings (`poll`, where readings are further apart than the driver's
  ring of 72 samples lasts); a device that does not support them is not asked again. Each
  read is handed on as a SampleBatch, from which the activity rule judges whether a quiet
  process is idle or merely unsampled (the sampler names one process per sample, about 5 a
  second). A process without a
  sample showing work since the last reading is `active` False where the device answers, and
  unknown (None) where it does not (nor for an MPS client, sampled under the server's pid: see
  base.activity).
* What cannot change while NVML stays initialised is read once: the versions, each GPU's name
  and PCI bus ID, and its MIG mode (a change of MIG mode takes a GPU reset, which ends the
  session's handles); nvmlDeviceGetMigMode cost 0.7 ms a call on the real driver.
* Pids are validated later against the proc root; one outside the valid range makes the whole
  list suspect (see above) and is counted as an error.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import re
import struct
from collections import Counter
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from gpuusage import __version__
from gpuusage.api.models import (
    GPU_UUID_PATTERN,
    MAX_DETAIL,
    MAX_GPUS,
    MAX_MESSAGE,
    MAX_MIB,
    MAX_MIG_DEVICES,
    MAX_MIG_UUID,
    MAX_PID,
    MIG_UUID_PATTERN,
    DeviceError,
    Gpu,
    Memory,
    MigDevice,
    ProcessType,
    Source,
    Utilization,
    safe_text,
)
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading, activity, error_reason
from gpuusage_nodeagent.gpusource.sampling import (
    Latest,
    SampleBatch,
    SampleCursor,
    share_batch,
    share_since,
)
from gpuusage_nodeagent.resolver import clean_name

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# Errors that mean "no usable NVML on this node" rather than "a GPU misbehaves".
_LIBRARY_ERRORS = (
    "LibraryNotFound",
    "DriverNotLoaded",
    "LibRmVersionMismatch",
    "NoPermission",
    "Uninitialized",
    "FunctionNotFound",
)
_DRIVER_GONE = ("DriverNotLoaded", "Uninitialized", "LibRmVersionMismatch")
"""Errors on a GPU that mean the driver under the session went away (unloaded, replaced):
NVML is shut down, so that no handle holds what is left of it, and initialised again later."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _mib(value: int | None) -> int | None:
    if value is None:
        return None
    return min(int(value) // MIB, MAX_MIB)


_GPU_UUID = re.compile(GPU_UUID_PATTERN)
_MIG_UUID = re.compile(MIG_UUID_PATTERN)
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE_ulonglong: memory unknown


def _used_mib(used_bytes: int) -> int | None:
    """A process's memory from NVML's figure (None where NVML says it is not available)."""
    return None if used_bytes == NOT_AVAILABLE else _mib(used_bytes)


_UNNAMED = "\0"
"""A pid whose name was not asked for yet (no name NVML gives is a NUL: see clean_name)."""
Merged = dict[int, tuple[tuple[ProcessType, ...], int | None]]
"""pid → (the lists it is in, its memory in MiB or None)."""


@functools.cache
def _unpacker(entry: Any, fields: tuple[str, ...]) -> struct.Struct:
    """Unpacks `fields` (32- or 64-bit unsigned) of one ctypes struct, located by the struct's
    own offsets, skipping the rest: one layout for every NVML array the agent reads."""
    layout, position = "=", 0
    for name in fields:
        offset, size = getattr(entry, name).offset, getattr(entry, name).size
        layout += f"{offset - position}x" + {4: "I", 8: "Q"}[size]
        position = offset + size
    return struct.Struct(layout + f"{ctypes.sizeof(entry) - position}x")


PROCESS_FIELDS = ("pid", "usedGpuMemory")
PROCESS_KINDS: dict[str, tuple[str, str]] = {
    # kind: (the unversioned calls' base name, the name of NVML's process mode constant)
    "compute": ("nvmlDeviceGetComputeRunningProcesses", "NVML_PROCESS_MODE_COMPUTE"),
    "graphics": ("nvmlDeviceGetGraphicsRunningProcesses", "NVML_PROCESS_MODE_GRAPHICS"),
    "mps": ("nvmlDeviceGetMPSComputeRunningProcesses", "NVML_PROCESS_MODE_MPS"),
}
LIST_CALLS = ("detail", "v3", "v2")
"""The ways to read a process list, in the order tried (see the module docstring)."""


_CALL_ABSENT = ("FunctionNotFound", "NotSupported", "ArgumentVersionMismatch")
"""Errors by which a driver says it has no such call (or not for this struct version)."""


class _Unsupported(Exception):
    """The bindings lack what a call needs (an older nvidia-ml-py)."""


class GarbledProcessList(Exception):
    """Every call the driver has gave a process list with an impossible pid."""

    def __init__(self, pids: list[int]) -> None:
        shown = ", ".join(str(p) for p in sorted(set(pids))[:4])
        super().__init__(
            f"NVML's process list holds impossible pids ({shown}): the driver and the bindings "
            "disagree on its layout, so the list is not used"
        )


def impossible(pid: int) -> bool:
    """A pid no process can have (0, above PID_MAX_LIMIT: 0xFFFFFFFF and other garbage)."""
    return not 1 <= pid <= MAX_PID


def plausible(rows: list[tuple[int, int]]) -> bool:
    """Whether every (pid, ...) row of a list has a possible pid: its lowest and highest pids
    are checked, not every one (a cycle reads hundreds)."""
    return not rows or (not impossible(min(rows)[0]) and not impossible(max(rows)[0]))


SAMPLE_FIELDS = ("pid", "timeStamp", "smUtil", "memUtil", "encUtil", "decUtil")


def memory_of(total: int, free: int, reserved: int | None) -> Memory:
    """Memory from NVML's byte counts: used is what is not free, the reserved part included
    (v1's `used`; v2's `used` excludes the reserved part on newer drivers, includes it on
    R510-R525, so the agent takes neither and reads total - free)."""
    total_mib = _mib(total) or 0
    used = min(max(int(total) - int(free), 0) // MIB, total_mib)
    kept = None if reserved is None else min(_mib(reserved) or 0, used)
    return Memory(total_mib=total_mib, used_mib=used, reserved_mib=kept)


def lower(before: Memory | None, after: Memory | None) -> Memory | None:
    """The two readings around a process list as one: the lower use (a process that started or
    ended between the reads is then on the list, or not counted; see visibility)."""
    if before is None or after is None or before.used_mib is None or after.used_mib is None:
        return after
    if before.used_mib >= after.used_mib:
        return after
    return after.model_copy(update={"used_mib": before.used_mib})


def garbled_error(exc: GarbledProcessList) -> DeviceError:
    return DeviceError(reason="InvalidProcessList", message=safe_text(str(exc), MAX_DETAIL))


def cuda_version(raw: int) -> str:
    """NVML's CUDA driver version integer (12040) as people write it (12.4)."""
    return f"{raw // 1000}.{(raw % 1000) // 10}"


class NvmlSource:
    """GpuSource over pynvml. `nvml` is the pynvml module (tests pass it with faked functions)."""

    def __init__(
        self,
        nvml: ModuleType | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._initialised = False
        self._init_error: str | None = None
        self._list_call: dict[str, int] = {}  # kind → index into LIST_CALLS of the call in use
        self._memory_v2 = True  # until the driver or the bindings show they lack it
        self._known_uuid: dict[int, str] = {}
        self._cursors: dict[str, SampleCursor] = {}  # each device's sampler reads, by UUID
        self._sampled: dict[str, Any] = {}  # the handles of the devices whose sampler is read
        self._batches: dict[str, list[SampleBatch]] = {}  # this reading's, by UUID
        self._share_batches: dict[str, list[SampleBatch]] = {}  # short reads, by UUID
        self._share_read: dict[str, datetime] = {}  # when each device's last short read ended
        self._util_unsupported: set[str] = set()
        self._errors: Counter[str] = Counter()
        # Process names by pid: asked of NVML once per process, kept while the pid stays listed.
        self._names: dict[int, str | None] = {}
        self._names_seen: dict[int, str | None] = {}
        self._buffers: dict[str, Any] = {}  # reused ctypes arrays, by C symbol
        # Facts that cannot change while NVML stays initialised, read once (each read goes
        # through pynvml's wrappers): the versions, and each GPU's name and PCI bus ID by UUID.
        # Kept only when read completely, so a transient failure is retried next cycle.
        self._source: Source | None = None
        self._static: dict[str, tuple[str | None, str | None, int | None]] = {}
        self._mig_mode: dict[str, bool] = {}

    # -- library ---------------------------------------------------------------------------
    def _module(self) -> ModuleType:
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        return self._nvml

    def _init(self) -> bool:
        if self._initialised:
            return True
        nvml = self._module()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            message = safe_text(
                f"NVML unavailable ({error_reason(exc)}: {exc}); idling, will retry", MAX_MESSAGE
            )
            if message != self._init_error:
                log.warning("%s", message)
            self._init_error = message
            self._errors[error_reason(exc)] += 1
            return False
        except OSError as exc:  # pynvml surfaces some loader failures as OSError
            self._init_error = safe_text(
                f"NVML unavailable ({exc}); idling, will retry", MAX_MESSAGE
            )
            self._errors["LibraryNotFound"] += 1
            return False
        if self._init_error:
            log.info("NVML initialised after earlier failure: %s", self._init_error)
        self._initialised, self._init_error = True, None
        self._source, self._static, self._mig_mode, self._sampled = None, {}, {}, {}
        return True

    def close(self) -> None:
        if self._initialised:
            nvml = self._module()
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._initialised = False

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call an NVML function; count and re-raise errors."""
        nvml = self._module()
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            self._errors[error_reason(exc)] += 1
            raise

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call an NVML function whose failure only leaves a field empty."""
        nvml = self._module()
        try:
            return self._try(fn, *args)
        except nvml.NVMLError:
            return None

    # -- reading ---------------------------------------------------------------------------
    def poll(self) -> None:
        """Read the sampler of every device read at the last reading (see the docstring)."""
        if not self._initialised:
            return
        for uuid, handle in list(self._sampled.items()):
            self._sample(handle, uuid)

    def sample_shares(self, devices: Collection[str], span: float) -> None:
        """Read the last `span` seconds of the samplers of `devices` (see share)."""
        if not self._initialised:
            return
        nvml = self._module()
        for uuid, handle in list(self._sampled.items()):
            if uuid not in devices:
                continue
            since = share_since(self._clock(), span, self._share_read.get(uuid))
            try:
                samples = self._raw_samples(handle, int(since.timestamp() * 1_000_000))
            except nvml.NVMLError_NotFound:
                samples = []  # no sample in the span: nothing ran
            except nvml.NVMLError as exc:
                self._errors[error_reason(exc)] += 1
                continue
            at = self._share_read[uuid] = self._clock()  # after the call: its samples are in
            batch = share_batch(samples, at, (at - since).total_seconds())
            self._share_batches.setdefault(uuid, []).append(batch)

    def read(self) -> Reading:
        """The node's GPUs; its errors are those since the last reading (the sampler reads
        between readings count too)."""
        self._batches = {}
        self._names_seen = {}
        try:
            return self._read()
        finally:
            self._names = self._names_seen
            self._errors = Counter()  # the reading keeps the one it was given

    def _read(self) -> Reading:
        if not self._init():
            source = Source(
                kind="nvml", available=False, message=self._init_error, agent_version=__version__
            )
            return Reading(source, [], self._errors)
        nvml = self._module()
        source = self._source or self._read_source()
        try:
            count = int(self._try(nvml.nvmlDeviceGetCount))
        except nvml.NVMLError as exc:
            failed = Source(
                kind="nvml",
                available=False,
                message=safe_text(f"cannot count GPUs ({error_reason(exc)}: {exc})", MAX_MESSAGE),
                driver_version=source.driver_version,
                agent_version=__version__,
            )
            if error_reason(exc) in _LIBRARY_ERRORS:
                self.close()
            return Reading(failed, [], self._errors)
        processes: dict[str, list[RawProcess]] = {}
        gpus = [self._gpu(index, processes) for index in range(min(count, MAX_GPUS))]
        if any(g.error is not None and g.error.reason in _DRIVER_GONE for g in gpus):
            log.warning("the NVIDIA driver went away during the reading: NVML shut down")
            self.close()
        if count > MAX_GPUS:  # a report holds so many (see api.models); say what is left out
            note = f"{count - MAX_GPUS} GPUs beyond the first {MAX_GPUS} are not reported"
            source = source.model_copy(update={"message": note})
        shares, self._share_batches = self._share_batches, {}
        return Reading(source, gpus, self._errors, processes, self._batches, shares)

    def _read_source(self) -> Source:
        nvml = self._module()
        source = Source(
            kind="nvml",
            available=True,
            driver_version=self._optional_text(nvml.nvmlSystemGetDriverVersion),
            nvml_version=self._optional_text(nvml.nvmlSystemGetNVMLVersion),
            cuda_version=self._cuda(),
            agent_version=__version__,
        )
        if source.driver_version and source.nvml_version and source.cuda_version:
            self._source = source
        return source

    def _gpu_static(self, handle: Any, uuid: str) -> tuple[str | None, str | None, int | None]:
        """(name, PCI bus ID, minor number) of a GPU."""
        known = self._static.get(uuid)
        if known is not None:
            return known
        nvml = self._module()
        pci = self._optional(nvml.nvmlDeviceGetPciInfo, handle)
        name = self._optional_text(nvml.nvmlDeviceGetName, handle)
        bus_id = safe_text(_text(pci.busId), 32) if pci is not None else None
        minor = self._optional(nvml.nvmlDeviceGetMinorNumber, handle)
        minor = int(minor) if minor is not None and 0 <= int(minor) <= 254 else None
        if name is not None and bus_id is not None:
            self._static[uuid] = (name, bus_id, minor)
        return name, bus_id, minor

    def _optional_text(self, fn: Callable[..., Any], *args: Any) -> str | None:
        value = self._optional(fn, *args)
        return None if value is None else safe_text(_text(value), 64)

    def _cuda(self) -> str | None:
        nvml = self._module()
        getter = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or getattr(
            nvml, "nvmlSystemGetCudaDriverVersion", None
        )
        raw = self._optional(getter) if getter else None
        return cuda_version(int(raw)) if raw else None

    def _gpu(self, index: int, processes_by_uuid: dict[str, list[RawProcess]]) -> Gpu:
        """One GPU; its processes, and its MIG devices', go into processes_by_uuid."""
        nvml = self._module()
        uuid = self._known_uuid.get(index)
        try:
            handle = self._try(nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = _text(self._try(nvml.nvmlDeviceGetUUID, handle))
        except nvml.NVMLError as exc:
            return Gpu(index=index, uuid=uuid, error=self._device_error(exc, "GPU"))
        if not _GPU_UUID.match(uuid):  # a binding/driver mismatch reads garbage
            self._errors["InvalidUUID"] += 1
            message = safe_text(f"NVML gave the GPU UUID {uuid!r}, which is no GPU UUID", 256)
            return Gpu(
                index=index,
                uuid=self._known_uuid.get(index),
                error=DeviceError(reason="InvalidUUID", message=message),
            )
        self._known_uuid[index] = uuid
        error: DeviceError | None = None
        mig_enabled = self._mig_enabled(handle, uuid)
        mig_devices: list[MigDevice] = []
        before = self._memory(handle)
        try:
            if mig_enabled:
                mig_devices = self._mig_devices(handle, processes_by_uuid)
            else:
                processes_by_uuid[uuid] = self._processes(handle, uuid, with_utilization=True)
        except nvml.NVMLError as exc:
            error = self._device_error(exc, "processes")
        except GarbledProcessList as exc:
            error = garbled_error(exc)
        name, bus_id, minor = self._gpu_static(handle, uuid)
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=bus_id,
            minor_number=minor,
            memory=lower(before, self._memory(handle)),
            utilization=self._utilization(handle),
            mig_enabled=mig_enabled,
            mig_devices=mig_devices,
            error=error,
        )

    @staticmethod
    def _device_error(exc: BaseException, what: str) -> DeviceError:
        return DeviceError(
            reason=error_reason(exc), message=safe_text(f"reading {what}: {exc}", MAX_DETAIL)
        )

    def _memory(self, handle: Any) -> Memory | None:
        """The device's memory, with the driver's reserved part where the versioned call
        (nvmlDeviceGetMemoryInfo_v2, R510+) is there; the unversioned one otherwise."""
        nvml = self._module()
        version = getattr(nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            try:
                info = self._try(nvml.nvmlDeviceGetMemoryInfo, handle, version)
                return memory_of(info.total, info.free, info.reserved)
            except (TypeError, nvml.NVMLError_FunctionNotFound, nvml.NVMLError_NotSupported):
                log.info("nvmlDeviceGetMemoryInfo_v2 unavailable; memory without its reserved part")
                self._memory_v2 = False
            except nvml.NVMLError as exc:
                if error_reason(exc) != "ArgumentVersionMismatch":
                    return None
                self._memory_v2 = False
        info = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
        return None if info is None else memory_of(info.total, info.free, None)

    def _utilization(self, handle: Any) -> Utilization | None:
        rates = self._optional(self._module().nvmlDeviceGetUtilizationRates, handle)
        if rates is None:
            return None
        return Utilization(
            gpu_percent=min(int(rates.gpu), 100), memory_percent=min(int(rates.memory), 100)
        )

    def _mig_enabled(self, handle: Any, uuid: str) -> bool | None:
        """The GPU's current MIG mode, asked once per NVML session (see the docstring)."""
        known = self._mig_mode.get(uuid)
        if known is not None:
            return known
        nvml = self._module()
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            enabled = False  # not a MIG-capable GPU: an answer, not an error
        except nvml.NVMLError as exc:
            self._errors[error_reason(exc)] += 1
            return None
        else:
            enabled = bool(current == nvml.NVML_DEVICE_MIG_ENABLE)
        self._mig_mode[uuid] = enabled
        return enabled

    def _mig_devices(
        self, parent: Any, processes_by_uuid: dict[str, list[RawProcess]]
    ) -> list[MigDevice]:
        nvml = self._module()
        count = int(self._try(nvml.nvmlDeviceGetMaxMigDeviceCount, parent))
        devices: list[MigDevice] = []
        for index in range(min(count, MAX_MIG_DEVICES)):
            try:
                handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
            except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
                continue  # empty slot
            try:
                uuid = _text(self._try(nvml.nvmlDeviceGetUUID, handle))
            except nvml.NVMLError as exc:
                log.warning("MIG device %d: cannot read UUID: %s", index, exc)
                continue
            if not _MIG_UUID.match(uuid) or len(uuid) > MAX_MIG_UUID:
                self._errors["InvalidUUID"] += 1
                log.warning("MIG device %d: NVML gave %r, which is no MIG UUID", index, uuid)
                continue
            error = None
            before = self._memory(handle)
            try:
                processes_by_uuid[uuid] = self._processes(handle, uuid, with_utilization=False)
            except nvml.NVMLError as exc:
                error = self._device_error(exc, "processes")
            except GarbledProcessList as exc:
                error = garbled_error(exc)
            devices.append(
                MigDevice(
                    index=index,
                    uuid=uuid,
                    name=self._optional_text(nvml.nvmlDeviceGetName, handle),
                    gpu_instance_id=self._optional(nvml.nvmlDeviceGetGpuInstanceId, handle),
                    compute_instance_id=self._optional(nvml.nvmlDeviceGetComputeInstanceId, handle),
                    memory=lower(before, self._memory(handle)),
                    error=error,
                )
            )
        return devices

    def _process_list(self, kind: str, handle: Any) -> list[tuple[int, int]]:
        """One NVML process list as (pid, used bytes or NOT_AVAILABLE), through the first call
        of LIST_CALLS the driver has whose list holds only possible pids.

        A call the driver lacks is never tried again; one whose list held an impossible pid
        is passed over for good once a later call reads the same list true. Raises
        GarbledProcessList when no call does."""
        nvml = self._module()
        garbled: list[int] = []
        first = self._list_call.get(kind, 0)
        for index in range(first, len(LIST_CALLS)):
            call, last = LIST_CALLS[index], index == len(LIST_CALLS) - 1
            try:
                rows = self._list_by(call, kind, handle)
            except (nvml.NVMLError, _Unsupported) as exc:
                absent = isinstance(exc, _Unsupported) or error_reason(exc) in _CALL_ABSENT
                if not absent or last:
                    if isinstance(exc, nvml.NVMLError):
                        self._errors[error_reason(exc)] += 1
                    raise
                log.info("%s process list: no %s call (%s); trying the next", kind, call, exc)
                self._list_call[kind] = index + 1
                continue
            bad = [] if plausible(rows) else [pid for pid, _ in rows if impossible(pid)]
            if not bad:
                if garbled and self._list_call.get(kind, 0) != index:
                    log.warning(
                        "%s process list: %s gave impossible pids %s; using %s from now on",
                        kind,
                        LIST_CALLS[first],
                        sorted(set(garbled))[:4],
                        call,
                    )
                    self._list_call[kind] = index
                return rows
            self._errors["InvalidPid"] += len(bad)
            garbled += bad
        raise GarbledProcessList(garbled)

    def _list_by(self, call: str, kind: str, handle: Any) -> list[tuple[int, int]]:
        base, mode = PROCESS_KINDS[kind]
        if call == "detail":
            return self._detail_processes(handle, mode)
        return self._raw_processes(f"{base}_{call}", handle)

    def _detail_processes(self, handle: Any, mode_name: str) -> list[tuple[int, int]]:
        """nvmlDeviceGetRunningProcessDetailList: the versioned call. Its list struct carries
        the version, the mode and the caller's array (see _into_array) with its length."""
        nvml = self._module()
        entry = getattr(nvml, "c_nvmlProcessDetail_v1_t", None)
        version = getattr(nvml, "nvmlProcessDetailList_v1", None)
        if entry is None or version is None or not hasattr(nvml, mode_name):
            raise _Unsupported("the bindings predate nvmlDeviceGetRunningProcessDetailList")

        def call(fn: Any, array: Any, count: Any) -> int:
            listing = nvml.c_nvmlProcessDetailList_v1_t()
            listing.version = version
            listing.mode = getattr(nvml, mode_name)
            listing.numProcArrayEntries = count.value
            listing.procArray = ctypes.cast(array, ctypes.POINTER(entry))
            ret = int(fn(handle, ctypes.byref(listing)))
            count.value = listing.numProcArrayEntries  # what it filled, or how many there are
            return ret

        data = self._into_array("nvmlDeviceGetRunningProcessDetailList", entry, call)
        return list(_unpacker(entry, PROCESS_FIELDS).iter_unpack(data))

    def _into_array(self, symbol: str, entry: Any, call: Callable[[Any, Any, Any], int]) -> bytes:
        """Call an NVML C function that fills an array of `entry` structs; the filled bytes.

        pynvml's wrappers turn every entry into a structure whose every field read runs
        Python code; at 8 GPUs x 64 processes that was the largest single cost of a cycle.
        The array is kept per function and grows when NVML says it is too small.
        call(fn, array, count) performs the call with the function's other arguments.
        """
        nvml = self._module()
        fn = nvml._nvmlGetFunctionPointer(symbol)  # NVMLError_FunctionNotFound when absent
        buffer = self._buffers.get(symbol)
        if buffer is None:
            buffer = self._buffers[symbol] = (entry * 64)()
        count = ctypes.c_uint(len(buffer))
        ret = call(fn, buffer, count)
        while ret == nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            buffer = self._buffers[symbol] = (entry * (count.value * 2 + 16))()
            count = ctypes.c_uint(len(buffer))
            ret = call(fn, buffer, count)
        nvml._nvmlCheckReturn(ret)
        return ctypes.string_at(buffer, count.value * ctypes.sizeof(entry))

    def _raw_processes(self, symbol: str, handle: Any) -> list[tuple[int, int]]:
        """(pid, used bytes or NOT_AVAILABLE) of one process list."""
        nvml = self._module()
        v2 = symbol.endswith("_v2")
        # Bindings before 12.550 name no v3 struct: the driver's v3 has the v2 layout.
        v3 = getattr(nvml, "c_nvmlProcessInfo_v3_t", nvml.c_nvmlProcessInfo_v2_t)
        entry = nvml.c_nvmlProcessInfo_v2_t if v2 else v3
        data = self._into_array(
            symbol, entry, lambda fn, array, count: fn(handle, ctypes.byref(count), array)
        )
        return list(_unpacker(entry, PROCESS_FIELDS).iter_unpack(data))

    @staticmethod
    def _merged(listed: list[tuple[ProcessType, list[tuple[int, int]]]]) -> Merged:
        """Several kinds' lists as one: a process listed by more than one kind is one process,
        with the larger figure."""
        merged: Merged = {}
        for kind, entries in listed:
            for pid, used_bytes in entries:
                used = _used_mib(used_bytes)
                known = merged.get(pid)
                if known is None:
                    merged[pid] = ((kind,), used)
                else:
                    types, before = known
                    if kind not in types:
                        types += (kind,)
                    merged[pid] = (types, before if used is None else max(used, before or 0))
        return merged

    def _processes(self, handle: Any, uuid: str, with_utilization: bool) -> list[RawProcess]:
        nvml = self._module()
        kinds: tuple[ProcessType, ...] = ("compute", "graphics", "mps")
        listed: list[tuple[ProcessType, list[tuple[int, int]]]] = []
        for kind in kinds:
            try:
                entries = self._process_list(kind, handle)
            except nvml.NVMLError_NotSupported:
                continue  # e.g. MPS on pre-Volta, graphics on compute-only boards
            if entries:
                listed.append((kind, entries))
        if len(listed) == 1:  # the usual case: one list, nothing to merge
            kind, entries = listed[0]
            only: tuple[ProcessType, ...] = (kind,)
            merged: Merged = {pid: (only, _used_mib(used)) for pid, used in entries}
        else:
            merged = self._merged(listed)
        utilization = self._process_utilization(handle, uuid) if with_utilization else None
        samples = utilization or {}
        quiet: tuple[int | None, int | None, bool | None] = (
            None,
            None,
            None if utilization is None else False,
        )  # no sample since the last reading: no engine ran it (the driver samples all)
        names, seen = self._names, self._names_seen
        processes = []
        for pid, (types, used) in sorted(merged.items()):
            sm, mem, busy = samples.get(pid, quiet)
            name = names.get(pid, _UNNAMED)
            if name is _UNNAMED:
                name = clean_name(self._optional(nvml.nvmlSystemGetProcessName, pid))
            seen[pid] = name
            processes.append(RawProcess(pid, name, used, types, sm, mem, activity(types, busy)))
        return processes

    def _raw_samples(self, handle: Any, since: int) -> list[tuple[int, int, int, int, int, int]]:
        """(pid, timestamp, SM %, memory %, encoder %, decoder %) samples newer than `since`."""
        entry = self._module().c_nvmlProcessUtilizationSample_t
        stamp = ctypes.c_ulonglong(since)
        data = self._into_array(
            "nvmlDeviceGetProcessUtilization",
            entry,
            lambda fn, array, count: fn(handle, array, ctypes.byref(count), stamp),
        )
        return list(_unpacker(entry, SAMPLE_FIELDS).iter_unpack(data))

    def _sample(self, handle: Any, uuid: str) -> bool:
        """One read of a device's sampler into its cursor; False where it could not be read."""
        nvml = self._module()
        if uuid in self._util_unsupported:
            return False
        cursor = self._cursors.setdefault(uuid, SampleCursor())
        try:
            samples = self._raw_samples(handle, cursor.since_us)
        except nvml.NVMLError_NotSupported:
            self._util_unsupported.add(uuid)
            self._sampled.pop(uuid, None)
            return False
        except nvml.NVMLError_NotFound:
            samples = []  # no sample since the last read: nothing ran
        except nvml.NVMLError as exc:
            self._errors[error_reason(exc)] += 1
            return False
        cursor.take(samples, self._clock())
        self._sampled[uuid] = handle
        return True

    def _process_utilization(self, handle: Any, uuid: str) -> Latest | None:
        """Per pid with samples since the last reading: the latest sample's SM and memory
        percentages and whether any sample showed work (see sampling). None: the device does
        not tell, or its sampler could not be read now. The reads since the last reading go
        into this reading's batches."""
        read = self._sample(handle, uuid)
        cursor = self._cursors.get(uuid)
        if cursor is None:
            return None
        batches, latest = cursor.drain()
        if not read:
            return None
        self._batches[uuid] = batches
        return latest
