"""Fake NVML machines built like real ones, installed by patching pynvml's own functions.

The fakes return pynvml's real ctypes structures (c_nvmlMemory_t, c_nvmlProcessInfo_v2_t, ...)
and raise pynvml's real error classes (NVMLError(NVML_ERROR_GPU_IS_LOST) is an
NVMLError_GpuIsLost). The process lists go one level deeper: the C symbols behind
`_nvmlGetFunctionPointer` are emulated (fill the caller's array, or say how large it must be),
so pynvml's own wrappers and the agent's direct calls marshal exactly as over a driver. With
`v3_missing=True` the _v3 symbols are absent, as on drivers older than R510; with
`detail_missing=True` the versioned nvmlDeviceGetRunningProcessDetailList is (drivers before
R550); `v3_grown=True` is the 535.43-535.86 driver whose _v3 symbol writes the grown 32-byte
struct into the caller's array of 24-byte ones. A process with `listed=False` holds memory the
driver counts but lists in no process list (a pid the driver cannot map into the caller's pid
namespace, a hidden runtime).

The machines behave as the real driver was measured to (gpusource.drivermodel): each CUDA
context costs the driver bookkeeping memory no process is charged with; per-process utilization
is a sampler on the machine's clock (`tick` moves it on), one process per sample, about 5 a
second, 72 kept (the first read finds the ring full of the processes' current work), a read
returning each process's latest sample; MPS clients' work is sampled under the server's pid;
with `own_pid_namespace=True` the caller is outside the host's pid namespace and, as the open
kernel module does, every list and sample leaves out the pids it cannot map (all of them);
with `costs=True` each call takes as long as it took on the real driver. Its `library` is the
driver version of the libnvidia-ml the process loaded (the driver's when the machine was made,
as the NVIDIA runtime mounts it when a container is created): with `driver` set to another
version (a driver upgrade) nvmlInit fails with LIB_RM_VERSION_MISMATCH, as the kernel refuses a
library of another version than its module's.
"""

from __future__ import annotations

import ctypes
import struct
import time
import uuid as uuidlib
from ctypes import Array
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pynvml
import pytest

from gpuusage_nodeagent.driverfacts import call_cost_ms
from gpuusage_nodeagent.gpusource.drivermodel import (
    MPS_SERVER,
    Sampler,
    Work,
    bookkeeping_mib,
    under_mps_server,
    work_of,
)

MIB = 1024 * 1024
NO_MIG = 0xFFFFFFFF
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
# The driver's layouts (pynvml's c_nvmlProcessInfo_v2_t/_v3_t and
# c_nvmlProcessUtilizationSample_t), native byte order and alignment.
PROC_INFO = struct.Struct("@IQII")
PROC_DETAIL = struct.Struct("@IQIIQ")  # c_nvmlProcessDetail_v1_t, and the grown 535.43 v3 struct
SAMPLE = struct.Struct("@IQIIII")


@dataclass
class FakeProcess:
    pid: int
    used_mib: int | None = 1024
    kinds: tuple[str, ...] = ("compute",)
    name: bytes | None = b"/usr/bin/python3.11"
    sm: int | None = None
    mem: int | None = None
    enc: int = 0
    dec: int = 0
    """What a sample of it shows; any above 0: busy (see drivermodel), sampled when its turn
    comes; all 0 or None: it has no work and is never sampled."""
    duty: float | None = None
    """Share of the time it has work, when busy (None: all the time)."""
    listed: bool = True
    """False: its memory is counted on the device, but no process list shows it."""


@dataclass
class FakeMig:
    index: int
    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    gi: int = 1
    ci: int = 0
    total_mib: int = 4864
    processes: list[FakeProcess] = field(default_factory=list)
    reserved_mib: int = 0


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total_mib: int = 81559
    used_mib: int | None = None
    """Memory in use, the reserved part included; None: reserved plus every process's."""
    reserved_mib: int = 0
    util: tuple[int, int] = (0, 0)
    processes: list[FakeProcess] = field(default_factory=list)
    mig: list[FakeMig] | None = None
    max_mig: int = 7
    handle_error: int | None = None
    uuid_error: int | None = None
    process_error: int | None = None
    util_supported: bool = True
    minor: int | None = None
    """The device node's minor number; None: its index."""
    sampler: Sampler | None = None
    """Its utilization sampler, made at the first query."""

    def work(self) -> dict[int, Work]:
        """What the sampler sees its processes do (an MPS client's work under the server)."""
        work = {}
        for p in self.processes:
            w = work_of(p.sm, p.mem, p.enc, p.dec)
            work[p.pid] = w if p.duty is None or not w.duty else Work(p.duty, *_engines(w))
        clients = [p.pid for p in self.processes if "mps" in p.kinds]
        server = next((p.pid for p in self.processes if p.name == MPS_SERVER.encode()), None)
        return under_mps_server(work, clients, server)


def _engines(work: Work) -> tuple[int, int, int, int]:
    return work.sm, work.mem, work.enc, work.dec


COSTED = {
    "nvmlDeviceGetProcessUtilization": "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetMigMode": "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMemoryInfo": "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUUID": "nvmlDeviceGetUUID",
}
"""The calls whose real cost was measured (driverfacts.CALL_COST_MS), by function name; every
process-list call costs as `process_list`."""


def gpu_uuid(seed: int) -> str:
    return "GPU-" + str(uuidlib.UUID(int=seed * 0x1000_0000_0001 + 0xABCDEF))


def mig_uuid(seed: int) -> str:
    return "MIG-" + str(uuidlib.UUID(int=seed * 0x2000_0000_0003 + 0x123456))


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass(frozen=True)
class Handle:
    gpu: int
    mig: int | None = None


class FakeMachine:
    """A node's GPUs as NVML would report them."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver: str = "550.54.15",
        cuda: int = 12040,
        init_error: int | None = None,
        v3_missing: bool = False,
        detail_missing: bool = False,
        v3_grown: bool = False,
        memory_v2_missing: bool = False,
        bookkeeping: bool = True,
        own_pid_namespace: bool = False,
        costs: bool = False,
    ) -> None:
        self.gpus = gpus
        self.driver = driver
        """The loaded kernel module's version."""
        self.library = driver
        """The loaded library's version (see the module docstring)."""
        self.cuda = cuda
        self.init_error = init_error
        self.v3_missing = v3_missing
        self.detail_missing = detail_missing
        self.v3_grown = v3_grown
        self.memory_v2_missing = memory_v2_missing
        self.bookkeeping = bookkeeping
        self.own_pid_namespace = own_pid_namespace
        self.costs = costs
        self.calls: list[str] = []
        self.initialised = False
        self.clock_us = 1_700_000_000_000_000
        """The driver's clock (µs), moved on by tick."""

    def now(self) -> datetime:
        """The driver's clock as a datetime (a source's clock on this machine)."""
        return datetime.fromtimestamp(self.clock_us / 1_000_000, UTC)

    def tick(self, seconds: float) -> None:
        """Let `seconds` pass: every GPU's sampler samples its processes' current work."""
        self._advance()
        self.clock_us += int(seconds * 1_000_000)
        self._advance()

    def _advance(self) -> None:
        for gpu in self.gpus:
            if gpu.mig is None and gpu.util_supported:
                if gpu.sampler is None:
                    gpu.sampler = Sampler(gpu.uuid, history=True)
                gpu.sampler.advance(self.clock_us, gpu.work())

    def costed(self, name: str, fn: Any) -> Any:
        """With `costs`: `fn` taking as long as the call took on the real driver (or its own
        time, where that is longer), spent on the CPU as the driver spends it."""
        call = COSTED.get(name, "process_list" if "RunningProcess" in name else None)
        if not self.costs or call is None:
            return fn

        def charged(*args: Any) -> Any:
            end = time.perf_counter() + call_cost_ms(call, self._processes_on(args[0])) / 1000
            try:
                return fn(*args)
            finally:
                while time.perf_counter() < end:
                    pass

        return charged

    def _processes_on(self, handle: Any) -> int:
        if not isinstance(handle, Handle):
            return 0
        on = self._gpu(handle) if handle.mig is None else self._mig(handle)
        return len(on.processes)

    # -- lookup helpers --------------------------------------------------------------------
    def _gpu(self, handle: Handle) -> FakeGpu:
        return self.gpus[handle.gpu]

    def _mig(self, handle: Handle) -> FakeMig:
        migs = self._gpu(handle).mig or []
        return next(m for m in migs if m.index == handle.mig)

    def _procs(self, handle: Handle, kind: str) -> list[FakeProcess]:
        self.calls.append(f"{kind}:{handle}")
        gpu = self._gpu(handle)
        if handle.mig is None and gpu.mig is not None:
            # Unprivileged callers get nothing useful from the parent of MIG devices.
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)
        if gpu.process_error is not None:
            raise _err(gpu.process_error)
        procs = self._mig(handle).processes if handle.mig is not None else gpu.processes
        if self.own_pid_namespace:
            return []  # the open kernel module: no host pid maps into the caller's namespace
        return [p for p in procs if kind in p.kinds and p.listed]

    # -- the emulated C symbols ------------------------------------------------------------
    def _c_process_fn(self, kind: str, grown: bool = False) -> Any:
        def fn(handle: Handle, count_ref: Any, array: Array[Any] | None) -> int:
            try:
                procs = self._procs(handle, kind)
            except pynvml.NVMLError as exc:
                return int(exc.value)
            count = count_ref._obj  # byref(c_uint) carries the object it points to
            if array is None or count.value < len(procs):
                count.value = len(procs)
                return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE if procs else pynvml.NVML_SUCCESS)
            view = memoryview(array).cast("B")
            mig = self._mig(handle) if handle.mig is not None else None
            layout = PROC_DETAIL if grown else PROC_INFO
            for index, proc in enumerate(procs):
                if (index + 1) * layout.size > len(view):
                    break  # the grown struct overruns the caller's array: the end is lost
                self._pack_proc(view, index, mig, proc, layout)
            count.value = len(procs)
            return int(pynvml.NVML_SUCCESS)

        return fn

    def _c_detail_list(self, handle: Handle, listing_ref: Any) -> int:
        """nvmlDeviceGetRunningProcessDetailList: a versioned list struct pointing at the
        caller's array."""
        listing = listing_ref._obj
        if listing.version != pynvml.nvmlProcessDetailList_v1:
            return 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        kind = {0: "compute", 1: "graphics", 2: "mps"}[int(listing.mode)]
        try:
            procs = self._procs(handle, kind)
        except pynvml.NVMLError as exc:
            return int(exc.value)
        if not listing.procArray or listing.numProcArrayEntries < len(procs):
            listing.numProcArrayEntries = len(procs)
            return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE if procs else pynvml.NVML_SUCCESS)
        address = ctypes.cast(listing.procArray, ctypes.c_void_p).value or 0
        view = memoryview((ctypes.c_char * (len(procs) * PROC_DETAIL.size)).from_address(address))
        mig = self._mig(handle) if handle.mig is not None else None
        for index, proc in enumerate(procs):
            self._pack_proc(view.cast("B"), index, mig, proc, PROC_DETAIL)
        listing.numProcArrayEntries = len(procs)
        return int(pynvml.NVML_SUCCESS)

    @staticmethod
    def _pack_proc(
        view: memoryview,
        index: int,
        mig: FakeMig | None,
        proc: FakeProcess,
        layout: struct.Struct = PROC_INFO,
    ) -> None:
        """Write one process-info struct into the caller's array, as the driver does."""
        used = NOT_AVAILABLE if proc.used_mib is None else proc.used_mib * MIB
        fields = [proc.pid, used, mig.gi if mig else NO_MIG, mig.ci if mig else NO_MIG]
        if layout is PROC_DETAIL:
            fields.append(0)  # usedGpuCcProtectedMemory
        layout.pack_into(view, index * layout.size, *fields)

    def _c_utilization(
        self, handle: Handle, array: Array[Any] | None, count_ref: Any, since: Any
    ) -> int:
        self.calls.append(f"utilization:{handle}")
        gpu = self._gpu(handle)
        if handle.mig is not None or not gpu.util_supported:
            return int(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._advance()
        assert gpu.sampler is not None
        samples = gpu.sampler.read(int(getattr(since, "value", since)))
        if self.own_pid_namespace:
            samples = []
        if not samples:
            return int(pynvml.NVML_ERROR_NOT_FOUND)
        count = count_ref._obj
        if array is None or count.value < len(samples):
            count.value = len(samples)
            return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        view = memoryview(array).cast("B")
        for index, sample in enumerate(samples):
            SAMPLE.pack_into(view, index * SAMPLE.size, *sample)
        count.value = len(samples)
        return int(pynvml.NVML_SUCCESS)

    def _function_pointer(self, name: str) -> Any:
        table = {}
        for kind, base in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
        ):
            table[base + "_v2"] = self._c_process_fn(kind)
            if not self.v3_missing:
                table[base + "_v3"] = self._c_process_fn(kind, grown=self.v3_grown)
        if not self.detail_missing:
            table["nvmlDeviceGetRunningProcessDetailList"] = self._c_detail_list
        table["nvmlDeviceGetProcessUtilization"] = self._c_utilization
        if name not in table:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self.costed(name, table[name])

    # -- installation ----------------------------------------------------------------------
    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Replace pynvml's functions with this machine's behaviour."""

        def init() -> None:
            if self.init_error is not None:
                raise _err(self.init_error)
            if self.library != self.driver:
                raise _err(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
            self.initialised = True

        def handle_by_index(index: int) -> Handle:
            if not 0 <= index < len(self.gpus):
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if self.gpus[index].handle_error is not None:
                raise _err(self.gpus[index].handle_error)  # type: ignore[arg-type]
            return Handle(index)

        def uuid(handle: Handle) -> str:
            if handle.mig is not None:
                return self._mig(handle).uuid
            gpu = self._gpu(handle)
            if gpu.uuid_error is not None:
                raise _err(gpu.uuid_error)
            return gpu.uuid

        def name(handle: Handle) -> str:
            return self._mig(handle).name if handle.mig is not None else self._gpu(handle).name

        def kept(processes: list[FakeProcess]) -> int:
            """What the driver keeps for their contexts (see drivermodel)."""
            return bookkeeping_mib(len(processes)) if self.bookkeeping else 0

        def memory(handle: Handle, version: int | None = None) -> Any:
            self.calls.append(f"memory:{handle}")
            if handle.mig is not None:
                mig = self._mig(handle)
                reserved = mig.reserved_mib
                used = reserved + sum(p.used_mib or 0 for p in mig.processes) + kept(mig.processes)
                total = mig.total_mib
            else:
                gpu = self._gpu(handle)
                reserved = gpu.reserved_mib
                used = reserved + sum(p.used_mib or 0 for p in gpu.processes) + kept(gpu.processes)
                used = used if gpu.used_mib is None else gpu.used_mib
                total = gpu.total_mib
            if not version:
                return pynvml.c_nvmlMemory_t(
                    total=total * MIB, free=(total - used) * MIB, used=used * MIB
                )
            if self.memory_v2_missing:
                raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            # Newer drivers' v2: used excludes the reserved part (total = reserved+free+used).
            return pynvml.c_nvmlMemory_v2_t(
                version=version,
                total=total * MIB,
                reserved=reserved * MIB,
                free=(total - used) * MIB,
                used=(used - reserved) * MIB,
            )

        def utilization(handle: Handle) -> Any:
            if handle.mig is not None:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            gpu_util, mem_util = self._gpu(handle).util
            return pynvml.c_nvmlUtilization_t(gpu=gpu_util, memory=mem_util)

        def pci(handle: Handle) -> Any:
            info = pynvml.nvmlPciInfo_t()
            info.busId = f"00000000:{0x18 + handle.gpu * 0x10:02X}:00.0".encode()
            return info

        def mig_mode(handle: Handle) -> list[int]:
            self.calls.append(f"migmode:{handle}")
            gpu = self._gpu(handle)
            if gpu.mig is None:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]

        def mig_handle(handle: Handle, index: int) -> Handle:
            gpu = self._gpu(handle)
            if index >= gpu.max_mig:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if all(m.index != index for m in gpu.mig or []):
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
            return Handle(handle.gpu, index)

        def all_names() -> dict[int, bytes]:
            return {
                proc.pid: proc.name
                for gpu in self.gpus
                for proc in gpu.processes + [p for m in gpu.mig or [] for p in m.processes]
                if proc.name is not None
            }

        known = all_names()

        def process_name(pid: int) -> bytes:
            self.calls.append(f"name:{pid}")
            if pid not in known:
                known.update(all_names())  # processes added after install
            if pid not in known:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
            return known[pid]

        patches: dict[str, Any] = {
            "nvmlInit": init,
            "nvmlShutdown": lambda: setattr(self, "initialised", False),
            "nvmlSystemGetDriverVersion": lambda: self.driver,
            "nvmlSystemGetNVMLVersion": lambda: "12." + self.driver,
            "nvmlSystemGetCudaDriverVersion_v2": lambda: self.cuda,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": handle_by_index,
            "nvmlDeviceGetUUID": uuid,
            "nvmlDeviceGetName": name,
            "nvmlDeviceGetPciInfo": pci,
            "nvmlDeviceGetMinorNumber": lambda h: (
                h.gpu if self._gpu(h).minor is None else self._gpu(h).minor
            ),
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetUtilizationRates": utilization,
            "nvmlDeviceGetMigMode": mig_mode,
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: self._gpu(h).max_mig,
            "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
            "nvmlDeviceGetGpuInstanceId": lambda h: self._mig(h).gi,
            "nvmlDeviceGetComputeInstanceId": lambda h: self._mig(h).ci,
            "nvmlSystemGetProcessName": process_name,
        }
        patches["_nvmlGetFunctionPointer"] = self._function_pointer
        for attr, value in patches.items():
            monkeypatch.setattr(pynvml, attr, self.costed(attr, value))


def dgx_h100(processes_per_gpu: int = 8, first_pid: int = 10_000) -> FakeMachine:
    """Eight H100s, each with processes_per_gpu processes, as on a busy DGX node."""
    gpus = []
    pid = first_pid
    for index in range(8):
        procs = []
        for _ in range(processes_per_gpu):
            procs.append(
                FakeProcess(pid=pid, used_mib=2048 + pid % 7 * 512, sm=pid % 100, mem=pid % 50)
            )
            pid += 1
        gpus.append(FakeGpu(uuid=gpu_uuid(index), reserved_mib=512, util=(87, 41), processes=procs))
    return FakeMachine(gpus)
