"""A device whose process list does not explain its memory is blind, not empty.

Driven through the real NVML source over fake drivers shaped like real ones (pynvml's own
structs), then through the agent's reader, then through the operator's pure core.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pynvml
import pytest

from gpuusage.api.models import Gpu, Memory, Source
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading
from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.main import NodeReader
from gpuusage_nodeagent.report import build_spec
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.visibility import (
    DEFAULT_ALLOWANCE_MIB,
    REASON,
    unexplained_mib,
    with_blind_devices,
)
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.allocation import AllocatedDevice, Allocation
from gpuusage_operator.judge.certainty import (
    REASON_NOT_VISIBLE,
    blind_spots,
    devices_of,
    sees_all,
    why_unknown,
)
from gpuusage_operator.judge.freshness import Sighting, freshness
from gpuusage_operator.judge.resolution import resolve_all
from gpuusage_operator.judge.status import desired_status
from tests.builders import marked_snapshot
from tests.fakenvml import FakeGpu, FakeMachine, FakeMig, FakeProcess, gpu_uuid, mig_uuid

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def _reading(machine: FakeMachine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> NodeReader:
    machine.install(monkeypatch)
    return NodeReader("n1", NvmlSource(pynvml), Resolver(tmp_path), clock=lambda: NOW)


def test_processes_the_driver_does_not_list_make_their_device_blind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Open kernel modules drop the pids they cannot map into the agent's pid namespace: the
    device lists one of its two processes (or none) while its memory counts both. Blind, with
    the listed process kept; a device whose list explains its memory is not."""
    partly = FakeGpu(
        uuid=gpu_uuid(0),
        reserved_mib=530,
        processes=[FakeProcess(pid=11, used_mib=4096), FakeProcess(pid=12, listed=False)],
    )
    none_listed = FakeGpu(
        uuid=gpu_uuid(1), reserved_mib=530, processes=[FakeProcess(pid=13, listed=False)]
    )
    fine = FakeGpu(uuid=gpu_uuid(2), reserved_mib=530, processes=[FakeProcess(pid=14)])
    spec = _reading(FakeMachine([partly, none_listed, fine]), monkeypatch, tmp_path).read().spec()
    first, second, third = spec.gpus
    assert first.error is not None
    assert first.error.reason == REASON
    assert "that its listed processes do not hold" in first.error.message
    assert [p.pid for p in first.processes] == [11]
    assert second.error is not None
    assert "but no process listed" in second.error.message
    assert third.error is None


def test_what_the_driver_keeps_and_jitter_within_the_allowance_are_not_blindness(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An idle H100 shows its reserved part used; drivers without the v2 memory call do not
    say it is reserved (2% of the memory is taken as such); a few MiB of bookkeeping is no
    hidden process."""
    idle = FakeGpu(uuid=gpu_uuid(0), reserved_mib=530)
    busy = FakeGpu(
        uuid=gpu_uuid(1),
        used_mib=530 + 1024 + DEFAULT_ALLOWANCE_MIB,
        reserved_mib=530,
        processes=[FakeProcess(pid=9)],
    )
    machine = FakeMachine([idle, busy])
    spec = _reading(machine, monkeypatch, tmp_path).read().spec()
    assert [g.error for g in spec.gpus] == [None, None]
    machine.memory_v2_missing = True
    old = _reading(machine, monkeypatch, tmp_path).read().spec()
    assert [g.error for g in old.gpus] == [None, None]
    assert old.gpus[0].memory is not None
    assert old.gpus[0].memory.reserved_mib is None


def test_mig_without_the_monitor_capability_says_what_it_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the MIG monitor capability the agent's lists of other GPU instances are empty:
    the MIG device is blind and says which capability is missing; its GPU is not judged (its
    memory is its slices')."""
    slices = [
        FakeMig(index=0, uuid=mig_uuid(0), processes=[FakeProcess(pid=21, listed=False)]),
        FakeMig(index=1, uuid=mig_uuid(1), processes=[FakeProcess(pid=22, used_mib=512)]),
    ]
    gpu = FakeGpu(uuid=gpu_uuid(0), name="NVIDIA A100-SXM4-40GB", mig=slices, used_mib=30000)
    spec = _reading(FakeMachine([gpu]), monkeypatch, tmp_path).read().spec()
    assert spec.gpus[0].error is None
    hidden, seen = spec.gpus[0].mig_devices
    assert hidden.error is not None
    assert hidden.error.reason == REASON
    assert "monitor capability" in hidden.error.message
    assert seen.error is None


def test_memory_a_listed_process_does_not_tell_cannot_be_weighed() -> None:
    memory = Memory(total_mib=81920, used_mib=60000, reserved_mib=500)
    told = RawProcess(10, "python", 1000, ("compute",))
    untold = RawProcess(11, "python", None, ("compute",))
    assert unexplained_mib(memory, [told]) == 60000 - 500 - 1000
    assert unexplained_mib(memory, [told, untold]) is None
    assert unexplained_mib(Memory(total_mib=81920), [told]) is None


def test_the_operator_keeps_a_blind_devices_pods_unknown_and_judges_the_others() -> None:
    """The pod last seen on the blind device is Unknown with ProcessesNotVisible (never
    ended); the status and its totals say which device is blind; a pod whose devices are
    known one by one and all visible can still be judged (idle, held idle); a pod whose
    devices are not known cannot."""
    gpu0, gpu1 = gpu_uuid(0), gpu_uuid(1)
    reading = with_blind_devices(
        _reading_of(
            [
                (gpu0, Memory(total_mib=81920, used_mib=40000, reserved_mib=500), []),
                (gpu1, Memory(total_mib=81920, used_mib=600, reserved_mib=500), []),
            ]
        )
    )
    spec = build_spec("n1", NOW, reading, {})
    blind = blind_spots(spec, resolve_all(spec, PodLookup()))
    cause = why_unknown(marked_snapshot(gpu0), blind)
    assert cause is not None
    assert cause.reason == REASON_NOT_VISIBLE
    assert why_unknown(marked_snapshot(gpu1), blind) is None
    pod = PodSnapshot("ml", "idle", "u-2", "n1", running=True)
    on_gpu1 = Allocation(("DevicePlugin",), (AllocatedDevice("kubelet", gpu1),), complete=True)
    on_gpu0 = Allocation(("DevicePlugin",), (AllocatedDevice("kubelet", gpu0),), complete=True)
    assert sees_all(blind, devices_of(on_gpu1, [], pod, spec))
    assert not sees_all(blind, devices_of(on_gpu0, [], pod, spec))
    assert not sees_all(blind, devices_of(Allocation(("DevicePlugin",)), [], pod, spec))
    assert not sees_all(blind, devices_of(on_gpu1, [], marked_snapshot(gpu0), spec))
    status = desired_status(
        spec, [], NOW, generation=1, fresh=freshness(Sighting(1, NOW), None, None, NOW), blind=blind
    )
    assert [(d.uuid, d.blind) for d in status.devices] == [
        (gpu0, "ProcessesNotVisible"),
        (gpu1, None),
    ]
    assert status.totals is not None
    assert status.totals.blind_devices == 1


def _reading_of(devices: list[tuple[str, Memory, list[RawProcess]]]) -> Reading:
    gpus = [Gpu(index=i, uuid=u, memory=m) for i, (u, m, _) in enumerate(devices)]
    return Reading(
        Source(kind="nvml", available=True), gpus, processes={u: p for u, _, p in devices}
    )
