"""NvmlSource against faked pynvml functions: full machines, MIG, broken GPUs and drivers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pynvml
import pytest

from gpuusage_nodeagent.gpusource.drivermodel import bookkeeping_mib
from gpuusage_nodeagent.gpusource.nvml import NvmlSource, cuda_version
from tests.fakenvml import (
    FakeGpu,
    FakeMachine,
    FakeMig,
    FakeProcess,
    dgx_h100,
    gpu_uuid,
    mig_uuid,
)


def _source(machine: FakeMachine, monkeypatch: pytest.MonkeyPatch) -> NvmlSource:
    machine.install(monkeypatch)
    return NvmlSource(pynvml)


def test_full_dgx_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    reading = _source(dgx_h100(), monkeypatch).read()
    assert reading.source.available
    assert reading.source.driver_version == "550.54.15"
    assert reading.source.cuda_version == "12.4"
    assert len(reading.gpus) == 8
    assert [g.index for g in reading.gpus] == list(range(8))
    assert len({g.uuid for g in reading.gpus}) == 8
    first = reading.gpus[0]
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory is not None
    assert first.memory.total_mib == 81559
    assert first.utilization is not None
    assert first.utilization.gpu_percent == 87
    assert first.pci_bus_id == "00000000:18:00.0"
    assert first.mig_enabled is False
    listed = reading.processes_of(first)
    assert len(listed) == 8
    assert first.processes == [], "a reading keeps processes apart from the device models"
    proc = listed[0]
    assert proc.pid == 10_000
    assert proc.name == "python3.11"
    assert proc.used_memory_mib == 2048 + 10_000 % 7 * 512
    assert proc.types == ("compute",)
    assert (proc.sm_util_percent, proc.memory_util_percent) == (None, None), (
        "at 0 % it has no work: the sampler never names it"
    )
    assert listed[1].sm_util_percent == 1
    assert sum(len(reading.processes_of(g)) for g in reading.gpus) == 64
    assert len(reading.all_processes()) == 64
    assert not reading.errors


def test_process_lists_are_merged_by_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(
        uuid=gpu_uuid(1),
        processes=[
            FakeProcess(pid=300, used_mib=900, kinds=("compute", "graphics")),
            FakeProcess(pid=301, used_mib=None, kinds=("mps",)),
            FakeProcess(pid=302, used_mib=100, kinds=("graphics",), name=b"/usr/lib/Xorg"),
        ],
    )
    reading = _source(FakeMachine([gpu]), monkeypatch).read()
    procs = {p.pid: p for p in reading.processes_of(reading.gpus[0])}
    assert procs[300].types == ("compute", "graphics")
    assert procs[300].used_memory_mib == 900
    assert procs[301].types == ("mps",)
    assert procs[301].used_memory_mib is None, "NVML 'not available' stays null, never 0"
    assert procs[302].name == "Xorg"


def test_mig_devices_are_queried_per_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    a100 = FakeGpu(
        uuid=gpu_uuid(2),
        name="NVIDIA A100-SXM4-40GB",
        total_mib=40960,
        mig=[
            FakeMig(0, mig_uuid(0), gi=1, ci=0, processes=[FakeProcess(pid=400, used_mib=3000)]),
            FakeMig(
                3,
                mig_uuid(3),
                name="NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                gi=2,
                ci=0,
                total_mib=19968,
                processes=[FakeProcess(pid=401, used_mib=15000, sm=50)],
            ),
        ],
    )
    machine = FakeMachine([a100, FakeGpu(uuid=gpu_uuid(3))])
    reading = _source(machine, monkeypatch).read()
    gpu = reading.gpus[0]
    assert gpu.mig_enabled is True
    assert reading.processes_of(gpu) == (), "processes live on the MIG devices"
    assert gpu.error is None
    assert [m.index for m in gpu.mig_devices] == [0, 3]
    slice3 = gpu.mig_devices[1]
    assert slice3.uuid == mig_uuid(3)
    assert slice3.name == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert (slice3.gpu_instance_id, slice3.compute_instance_id) == (2, 0)
    assert slice3.memory is not None
    assert slice3.memory.total_mib == 19968
    assert [p.pid for p in reading.processes_of(slice3)] == [401]
    assert reading.processes_of(slice3)[0].sm_util_percent is None, "none per process on MIG"
    assert [p.pid for p in reading.processes_of(gpu.mig_devices[0])] == [400]
    parent = [c for c in machine.calls if c.endswith("Handle(gpu=0, mig=None)")]
    assert not [c for c in parent if c.split(":")[0] not in ("memory", "migmode")], (
        "no process list of the parent"
    )
    assert reading.gpus[1].mig_enabled is False


def test_lost_gpu_is_reported_and_the_others_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = dgx_h100(processes_per_gpu=2)
    source = _source(machine, monkeypatch)
    assert source.read().gpus[3].uuid == gpu_uuid(3)
    machine.gpus[3].uuid_error = pynvml.NVML_ERROR_GPU_IS_LOST
    machine.gpus[5].handle_error = pynvml.NVML_ERROR_GPU_IS_LOST
    reading = source.read()
    lost = reading.gpus[3]
    assert lost.error is not None
    assert lost.error.reason == "GpuIsLost"
    assert lost.uuid == gpu_uuid(3), "a GPU read before keeps its UUID when lost"
    assert reading.gpus[5].error is not None
    assert reading.gpus[5].uuid == gpu_uuid(5)
    healthy = [g for g in reading.gpus if g.error is None]
    assert len(healthy) == 6
    assert all(len(reading.processes_of(g)) == 2 for g in healthy)
    assert reading.errors["GpuIsLost"] == 2


def test_lost_before_first_read_has_no_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0), handle_error=pynvml.NVML_ERROR_GPU_IS_LOST)])
    gpu = _source(machine, monkeypatch).read().gpus[0]
    assert gpu.uuid is None
    assert gpu.error is not None
    assert gpu.error.reason == "GpuIsLost"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, "NoPermission"),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, "NotSupported"),
        (pynvml.NVML_ERROR_UNKNOWN, "Unknown"),
    ],
)
def test_process_errors_stay_on_their_gpu(
    monkeypatch: pytest.MonkeyPatch, code: int, reason: str
) -> None:
    machine = dgx_h100(processes_per_gpu=1)
    machine.gpus[1].process_error = code
    reading = _source(machine, monkeypatch).read()
    broken = reading.gpus[1]
    if reason == "NotSupported":
        # Not supported process lists are an answer (no such processes), not a failure.
        assert broken.error is None
        assert reading.processes_of(broken) == []
    else:
        assert broken.error is not None
        assert broken.error.reason == reason
        assert broken.memory is not None, "what could be read is still reported"
    assert all(len(reading.processes_of(g)) == 1 for i, g in enumerate(reading.gpus) if i != 1)


def test_v3_process_call_missing_falls_back_to_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drivers older than R510 lack the _v3 symbols; pynvml's own _v2 wrappers take over."""
    machine = FakeMachine(
        [
            FakeGpu(
                uuid=gpu_uuid(7),
                processes=[
                    FakeProcess(pid=700, used_mib=5000),
                    FakeProcess(pid=701, used_mib=None, kinds=("graphics",)),
                ],
            )
        ],
        driver="470.223.02",
        v3_missing=True,
    )
    source = _source(machine, monkeypatch)
    for _ in range(2):
        reading = source.read()
        procs = {p.pid: p for p in reading.processes_of(reading.gpus[0])}
        assert procs[700].used_memory_mib == 5000
        assert procs[701].used_memory_mib is None
        assert procs[701].types == ("graphics",)
    assert source.read().source.driver_version == "470.223.02"


def test_library_missing_idles_and_says_so() -> None:
    """Real pynvml on this machine: there is no libnvidia-ml, exactly as on a non-GPU node."""
    source = NvmlSource(pynvml)
    reading = source.read()
    assert reading.source.available is False
    assert reading.source.kind == "nvml"
    assert reading.source.message is not None
    assert "LibraryNotFound" in reading.source.message
    assert reading.gpus == []
    assert reading.errors["LibraryNotFound"] == 1


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "DriverNotLoaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "LibRmVersionMismatch"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "NoPermission"),
    ],
)
def test_broken_driver_idles_then_recovers(
    monkeypatch: pytest.MonkeyPatch, code: int, reason: str
) -> None:
    machine = dgx_h100(processes_per_gpu=1)
    machine.init_error = code
    source = _source(machine, monkeypatch)
    reading = source.read()
    assert reading.source.available is False
    assert reading.source.message is not None
    assert reason in reading.source.message
    machine.init_error = None  # e.g. the driver finished loading
    recovered = source.read()
    assert recovered.source.available is True
    assert len(recovered.gpus) == 8


def test_process_lists_are_read_through_the_versioned_call_where_the_driver_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R550+: nvmlDeviceGetRunningProcessDetailList, whose struct carries its version, reads
    every list (compute, graphics, MPS) with its memory; no unversioned call is made."""
    gpu = FakeGpu(
        uuid=gpu_uuid(0),
        processes=[
            FakeProcess(pid=4242, used_mib=2048),
            FakeProcess(pid=77, used_mib=None, kinds=("graphics",)),
            FakeProcess(pid=88, used_mib=512, kinds=("mps", "compute")),
        ],
    )
    machine = FakeMachine([gpu])
    reading = _source(machine, monkeypatch).read()
    listed = {p.pid: (p.used_memory_mib, p.types) for p in reading.processes_of(reading.gpus[0])}
    assert listed == {
        77: (None, ("graphics",)),
        88: (512, ("compute", "mps")),
        4242: (2048, ("compute",)),
    }
    assert not reading.errors
    assert reading.gpus[0].error is None


@pytest.mark.parametrize(
    ("driver", "expected"),
    [
        ({"detail_missing": True}, "v3"),
        ({"detail_missing": True, "v3_missing": True}, "v2"),
        ({"detail_missing": True, "v3_grown": True}, "v2"),
    ],
    ids=["R510-R545", "older than R510", "535.43-535.86 (grown v3 struct)"],
)
def test_older_drivers_fall_back_in_order_and_a_grown_struct_is_never_misread(
    monkeypatch: pytest.MonkeyPatch, driver: dict[str, Any], expected: str
) -> None:
    """Without the versioned call: _v3, then _v2. The 535.43 driver's _v3 fills the array with
    a larger struct than the bindings read: the list shows impossible pids (0, 0xFFFFFFFF, the
    end lost); it is not used, _v2 reads the truth and is kept from then on."""
    procs = [FakeProcess(pid=pid, used_mib=1024 * (n + 1)) for n, pid in enumerate((11, 22, 33))]
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0), processes=procs)], **driver)
    source = _source(machine, monkeypatch)
    for _ in range(2):
        reading = source.read()
        listed = [(p.pid, p.used_memory_mib) for p in reading.processes_of(reading.gpus[0])]
        assert listed == [(11, 1024), (22, 2048), (33, 3072)]
        assert reading.gpus[0].error is None
    assert source._list_call["compute"] == ("detail", "v3", "v2").index(expected)


def test_a_list_no_call_reads_true_makes_the_device_unreadable_not_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Impossible pids in every call's list (a driver that writes garbage): the device says its
    processes cannot be read (InvalidProcessList), with the pids seen; never 'no process'."""
    gpu = FakeGpu(uuid=gpu_uuid(0), processes=[FakeProcess(pid=0), FakeProcess(pid=4242)])
    other = FakeGpu(uuid=gpu_uuid(1), processes=[FakeProcess(pid=5151)])
    machine = FakeMachine([gpu, other])
    reading = _source(machine, monkeypatch).read()
    broken = reading.gpus[0]
    assert broken.error is not None
    assert broken.error.reason == "InvalidProcessList"
    assert "impossible pids (0)" in broken.error.message
    assert not reading.processes_of(broken)
    assert [p.pid for p in reading.processes_of(reading.gpus[1])] == [5151]
    assert reading.errors["InvalidPid"] == 3  # the pid 0, once by each call


def test_bindings_without_the_versioned_call_use_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nvidia-ml-py before 12.550 has no c_nvmlProcessDetail_v1_t: the _v3 call is used."""
    monkeypatch.delattr(pynvml, "c_nvmlProcessDetail_v1_t")
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0), processes=[FakeProcess(pid=9)])])
    source = _source(machine, monkeypatch)
    reading = source.read()
    assert [p.pid for p in reading.processes_of(reading.gpus[0])] == [9]
    assert source._list_call["compute"] == 1


def test_memory_reports_the_reserved_part_and_the_lower_of_two_readings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """v2 memory gives the driver's reserved part; used is total - free either way. Memory is
    read before and after the lists: a process that starts between them is not counted."""
    gpu = FakeGpu(uuid=gpu_uuid(0), reserved_mib=530, processes=[FakeProcess(pid=9)])
    machine = FakeMachine([gpu])
    source = _source(machine, monkeypatch)
    reading = source.read()
    memory = reading.gpus[0].memory
    assert memory is not None
    kept = bookkeeping_mib(1)  # the driver's for the one context
    assert (memory.used_mib, memory.reserved_mib) == (530 + 1024 + kept, 530)
    machine.memory_v2_missing = True
    old = _source(machine, monkeypatch).read().gpus[0].memory
    assert old is not None
    assert (old.used_mib, old.reserved_mib) == (530 + 1024 + kept, None)

    real_list = machine._c_process_fn("compute")

    def starting_meanwhile(handle: Any, count: Any, array: Any) -> int:
        gpu.processes.append(FakeProcess(pid=10, used_mib=4096))
        return int(real_list(handle, count, array))

    machine.detail_missing = True
    monkeypatch.setattr(
        machine,
        "_function_pointer",
        lambda name: (
            starting_meanwhile
            if name.startswith("nvmlDeviceGetComputeRunning")
            else (FakeMachine._function_pointer(machine, name))
        ),
    )
    gpu.processes = [FakeProcess(pid=9)]
    reading = _source(machine, monkeypatch).read()
    memory = reading.gpus[0].memory
    assert memory is not None
    assert memory.used_mib == 530 + 1024 + kept, "the reading before the list"


def test_process_utilization_unsupported_is_not_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), util_supported=False, processes=[FakeProcess(pid=5, sm=9)])
    machine = FakeMachine([gpu])
    source = _source(machine, monkeypatch)
    source.read()
    source.read()
    assert [c for c in machine.calls if c.startswith("utilization:")] == [
        "utilization:Handle(gpu=0, mig=None)"
    ], "asked once, then remembered as unsupported"
    reading = source.read()
    assert reading.processes_of(reading.gpus[0])[0].sm_util_percent is None


def test_static_facts_are_read_once_per_nvml_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions, names and PCI bus IDs cannot change while NVML stays initialised; a failed
    read is not kept, so it is retried on the next reading."""
    source = _source(dgx_h100(processes_per_gpu=1), monkeypatch)
    asked: Counter[str] = Counter()
    failing = {"nvmlDeviceGetName": 1}  # the first call fails, as under a transient error

    def counted(name: str) -> Any:
        original = getattr(pynvml, name)

        def call(*args: Any) -> Any:
            asked[name] += 1
            if failing.get(name, 0) > 0:
                failing[name] -= 1
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return original(*args)

        return call

    for name in ("nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlSystemGetDriverVersion"):
        monkeypatch.setattr(pynvml, name, counted(name))
    first = source.read()
    assert first.gpus[0].name is None, "the failed read leaves the field empty"
    assert first.gpus[1].name == "NVIDIA H100 80GB HBM3"
    for _ in range(3):
        later = source.read()
    assert [g.name for g in later.gpus] == ["NVIDIA H100 80GB HBM3"] * 8
    assert [g.pci_bus_id for g in later.gpus] == [g.pci_bus_id for g in first.gpus]
    assert later.source.driver_version == "550.54.15"
    assert asked == {
        "nvmlDeviceGetName": 9,
        "nvmlDeviceGetPciInfo": 9,
        "nvmlSystemGetDriverVersion": 1,
    }
    source.close()  # a new session (e.g. after a driver reload) reads them again
    source.read()
    assert asked["nvmlSystemGetDriverVersion"] == 2
    assert asked["nvmlDeviceGetName"] == 17


def test_cuda_version_format() -> None:
    assert cuda_version(12040) == "12.4"
    assert cuda_version(11080) == "11.8"


def test_activity_since_the_last_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's sampler names only processes at work: no sample since the last reading
    means not seen at work where the device answers; a busy sample since the last query means
    active, whatever the process does at the reading; the percentage is its latest sample's."""
    gpu = FakeGpu(
        uuid=gpu_uuid(0),
        processes=[
            FakeProcess(pid=10),  # no work: never sampled
            FakeProcess(pid=11, sm=0),
            FakeProcess(pid=12, sm=35),
            FakeProcess(pid=13, sm=0),
        ],
    )
    blind = FakeGpu(uuid=gpu_uuid(1), util_supported=False, processes=[FakeProcess(pid=20, sm=9)])
    mig_gpu = FakeGpu(
        uuid=gpu_uuid(2),
        mig=[FakeMig(index=0, uuid=mig_uuid(0), processes=[FakeProcess(pid=30, sm=50)])],
    )
    machine = FakeMachine([gpu, blind, mig_gpu])
    source = _source(machine, monkeypatch)
    source.read()
    machine.tick(2)  # 12 alone at work
    gpu.processes[1].sm, gpu.processes[2].sm = 40, 0
    machine.tick(2)  # then 11 alone, 12 quiet at the reading
    reading = source.read()
    by_pid = {p.pid: p for p in reading.all_processes()}
    assert {pid: by_pid[pid].active for pid in (10, 11, 12, 13)} == {
        10: False,
        11: True,
        12: True,
        13: False,
    }
    assert by_pid[12].sm_util_percent == 35, "the published percentage is its latest sample's"
    assert by_pid[13].sm_util_percent is None, "never sampled: no percentage"
    assert by_pid[20].active is None, "the device does not report it"
    assert by_pid[30].active is None, "MIG devices have no per-process utilization"
    machine.tick(2)
    later = {p.pid: p.active for p in source.read().all_processes()}
    assert (later[11], later[12]) == (True, False), "12 had no sample since the last reading"
    quiet = FakeMachine([FakeGpu(uuid=gpu_uuid(0), processes=[FakeProcess(pid=10)])])
    (only,) = _source(quiet, monkeypatch).read().all_processes()
    assert only.active is False, "no sample at all (NOT_FOUND): nobody ran"


def test_activity_counts_every_engine_and_mps_clients_are_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transcoding pod uses NVENC/NVDEC and no SM: it is working, not idle. A process with
    no sample since the last reading did nothing (the driver samples every engine). An MPS
    client's work is sampled under the server's pid: its own quiet is unknown, never idle."""
    gpu = FakeGpu(
        uuid=gpu_uuid(0),
        processes=[
            FakeProcess(pid=5, sm=0, enc=60),
            FakeProcess(pid=6, sm=0, dec=35),
            FakeProcess(pid=7, sm=0),
            FakeProcess(pid=8),
            FakeProcess(pid=9, kinds=("mps",)),
            FakeProcess(pid=10, sm=40),
        ],
    )
    reading = _source(FakeMachine([gpu]), monkeypatch).read()
    active = {p.pid: p.active for p in reading.processes_of(reading.gpus[0])}
    assert active == {5: True, 6: True, 7: False, 8: False, 9: None, 10: True}


def test_mig_mode_is_asked_once_per_nvml_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of MIG mode takes a GPU reset, which ends the session's handles: the mode is
    read once a session (0.7 ms a call on the real driver), again after a new nvmlInit."""
    machine = FakeMachine(
        [
            FakeGpu(uuid=gpu_uuid(0), processes=[FakeProcess(pid=5)]),
            FakeGpu(uuid=gpu_uuid(1), mig=[FakeMig(index=0, uuid=mig_uuid(0))]),
        ]
    )
    source = _source(machine, monkeypatch)
    for _ in range(3):
        reading = source.read()
    assert [g.mig_enabled for g in reading.gpus] == [False, True]
    assert sum(c.startswith("migmode:") for c in machine.calls) == 2
    source.close()
    source.read()
    assert sum(c.startswith("migmode:") for c in machine.calls) == 4


def test_errors_of_the_sampler_reads_between_readings_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampler read between two readings that fails is counted in the next reading's
    errors (the agent's metrics), not lost."""
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0), processes=[FakeProcess(pid=5, sm=50)])])
    source = _source(machine, monkeypatch)
    assert not source.read().errors
    real = machine._c_utilization
    monkeypatch.setattr(machine, "_c_utilization", lambda *args: int(pynvml.NVML_ERROR_UNKNOWN))
    source.poll()
    monkeypatch.setattr(machine, "_c_utilization", real)
    assert source.read().errors == Counter({"Unknown": 1})
    assert not source.read().errors


def test_a_driver_gone_under_a_session_has_nvml_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU whose reads fail with DriverNotLoaded (the driver unloaded under the session) has
    NVML shut down, so no handle of the agent holds what is left of it; a GPU lost alone does
    not; the next reading initialises NVML again."""
    machine = dgx_h100(processes_per_gpu=1)
    source = _source(machine, monkeypatch)
    assert source.read().source.available

    def initialised() -> bool:  # read afresh each time (not narrowed by an earlier assert)
        return machine.initialised

    assert initialised()
    machine.gpus[3].handle_error = pynvml.NVML_ERROR_GPU_IS_LOST
    source.read()
    assert initialised(), "one lost GPU is no reason to let go of the others"
    machine.gpus[3].handle_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    gone = source.read()
    assert gone.gpus[3].error is not None
    assert gone.gpus[3].error.reason == "DriverNotLoaded"
    assert not initialised()
    machine.gpus[3].handle_error = None
    assert len(source.read().gpus) == 8
    assert initialised()
