"""The agent on a busy or misbehaving node: its report stays within the API's bounds (the largest
processes listed, the rest counted per device), garbage from NVML is an error on that GPU, and
an unexpected failure costs one cycle, never the agent. Through the real NVML code path, with
pynvml's functions faked."""

from __future__ import annotations

import threading
from collections.abc import Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpuusage.api import names
from gpuusage.api.models import MAX_GPUS, MAX_PROCESSES, Gpu, Memory
from gpuusage_nodeagent.caps import capped
from gpuusage_nodeagent.change import Decision
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading
from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.main import NodeReader, run_cycles
from gpuusage_nodeagent.metrics import AgentMetrics
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.certainty import REASON_OMITTED, blind_spots, why_unknown
from gpuusage_operator.judge.resolution import resolve_all
from tests.builders import FAKE_SOURCE
from tests.fakenvml import FakeGpu, FakeMachine, dgx_h100, gpu_uuid


def _reading(per_gpu: list[int]) -> Reading:
    gpus, processes, pid = [], {}, 1
    for index, count in enumerate(per_gpu):
        uuid = gpu_uuid(index)
        gpus.append(Gpu(index=index, uuid=uuid, memory=Memory(total_mib=81920)))
        listed = []
        for _ in range(count):
            listed.append(RawProcess(pid, None, pid % 1000, ("compute",)))
            pid += 1
        processes[uuid] = listed
    return Reading(FAKE_SOURCE, gpus, processes=processes)


def test_a_reading_within_bounds_is_left_as_it_is() -> None:
    reading = _reading([100, 100])
    assert capped(reading) is reading


def test_the_largest_processes_are_kept_and_the_rest_counted_per_device() -> None:
    reading = _reading([400, 300])  # 700 processes, 512 may be listed
    out = capped(reading)
    listed = [(u, p) for u, procs in out.processes.items() for p in procs]
    assert len(listed) == MAX_PROCESSES
    smallest_kept = min(p.used_memory_mib or 0 for _, p in listed)
    dropped = {(u, p.pid) for u, procs in reading.processes.items() for p in procs} - {
        (u, p.pid) for u, p in listed
    }
    assert len(dropped) == 700 - MAX_PROCESSES
    every = {(u, p.pid): p for u, procs in reading.processes.items() for p in procs}
    assert all((every[k].used_memory_mib or 0) <= smallest_kept for k in dropped)
    for gpu in out.gpus:
        gone = [every[k] for k in dropped if k[0] == gpu.uuid]
        assert gpu.omitted_processes == (len(gone) or None)
        assert gpu.omitted_memory_mib == (sum(p.used_memory_mib or 0 for p in gone) or None)
    assert sum(g.omitted_processes or 0 for g in out.gpus) == 700 - MAX_PROCESSES


def test_gpus_beyond_the_bound_are_left_out_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(uuid=gpu_uuid(i), used_mib=1024, util=(1, 1), processes=[]) for i in range(40)]
    FakeMachine(gpus).install(monkeypatch)
    reading = NvmlSource(pynvml).read()
    assert len(reading.gpus) == MAX_GPUS
    assert reading.source.message == f"{40 - MAX_GPUS} GPUs beyond the first 32 are not reported"


def test_a_busy_nvml_node_publishes_a_valid_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """8 GPUs x 100 processes through NVML: the spec validates (it used to fail with 422 on
    every write), lists 512 processes and counts the rest on their GPUs."""
    dgx_h100(processes_per_gpu=100).install(monkeypatch)
    reader = NodeReader(
        "n1",
        NvmlSource(pynvml),
        Resolver(tmp_path),
        clock=lambda: datetime(2026, 11, 23, tzinfo=UTC),
    )
    spec = reader.read().spec()
    listed = sum(len(g.processes) for g in spec.gpus)
    assert listed == MAX_PROCESSES
    assert sum(g.omitted_processes or 0 for g in spec.gpus) == 800 - MAX_PROCESSES
    # The operator takes a device with omitted processes as one it cannot fully see.
    blind = blind_spots(spec, resolve_all(spec, PodLookup()))
    omitted = next(g for g in spec.gpus if g.omitted_processes)
    pod = PodSnapshot(
        "ml",
        "p",
        "u",
        "n1",
        annotations=((names.ANNOTATION_GPUS, str(omitted.uuid)),),
        condition=(("status", "True"),),
    )
    cause = why_unknown(pod, blind)
    assert cause is not None
    assert cause.reason == REASON_OMITTED


def test_a_garbage_gpu_uuid_is_an_error_on_that_gpu_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A binding/driver mismatch can read garbage; the spec must still validate."""
    machine = dgx_h100(processes_per_gpu=2)
    machine.gpus[3].uuid = "GPU-\x00\x01garbage"
    machine.install(monkeypatch)
    reader = NodeReader(
        "n1",
        NvmlSource(pynvml),
        Resolver(tmp_path),
        clock=lambda: datetime(2026, 11, 23, tzinfo=UTC),
    )
    attributed = reader.read()
    spec = attributed.spec()
    broken = spec.gpus[3]
    assert broken.uuid is None
    assert broken.error is not None
    assert broken.error.reason == "InvalidUUID"
    assert [g.error for g in spec.gpus if g.index != 3] == [None] * 7
    assert attributed.reading.errors["InvalidUUID"] == 1


def test_an_unexpected_failure_costs_a_cycle_not_the_agent(tmp_path: Path) -> None:
    class Flaky:
        calls = 0

        def read(self) -> Reading:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("a bug in a source")
            return Reading(FAKE_SOURCE, [])

        def poll(self) -> None:
            """No sampler."""

        def sample_shares(self, devices: Collection[str], span: float) -> None:
            """No share reads."""

        def close(self) -> None:
            """Nothing to release."""

    stop = threading.Event()
    offered: list[int] = []

    class Recorder:
        def offer(self, attributed: Any, force: bool = False) -> Decision:
            offered.append(1)
            stop.set()
            return Decision(True, "first report")

    source = Flaky()
    metrics = AgentMetrics()
    settings = AgentSettings(node_name="n1", interval=0.01, metrics_port=0)
    run_cycles(
        settings,
        NodeReader("n1", source, Resolver(tmp_path)),
        Recorder(),  # type: ignore[arg-type]
        metrics,
        stop,
    )
    assert source.calls == 2, "the loop went on after the failure"
    assert offered == [1]
    failures = metrics.registry.get_sample_value(
        "gpuusage_agent_cycle_failures_total", {"kind": "RuntimeError"}
    )
    assert failures == 1
