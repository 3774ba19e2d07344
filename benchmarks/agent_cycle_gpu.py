"""The agent's cycle on a real GPU and driver, beside the driver calls no cycle can avoid.

`agent_cycle.py` charges each NVML call what it was measured to cost; this one measures both
sides on the real driver, in one run, interleaved: real CUDA tenants (tests.gpu.tenant, the
real-GPU suite's) share GPU 0, and each pair times one agent cycle (NVML, the pid resolver on
the host's /proc, the report's fingerprint and the write rule) and one round of the bare calls
(one sampler read from its own cursor, the three process lists, memory, UUID), made through
ctypes into arrays allocated beforehand, so that nothing of the agent's is in the floor. The
order within a pair alternates, so that drift falls on both sides alike.

    python benchmarks/agent_cycle_gpu.py [--tenants 64] [--busy 0.5] [--pairs 40] [--every 1]

Needs a GPU, NVML, the CUDA driver, and the agent's packages (devtools/gpu-suite.sh's setup).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pynvml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests package (the tenants)

from gpuusage_nodeagent.change import decide  # noqa: E402
from gpuusage_nodeagent.main import NodeReader  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402
from tests.gpu.machine import Tenants, agent, no_gpu_reason  # noqa: E402

ROOM = 1024
"""Entries in each preallocated array: more than the tenants and samples a read can return."""
NOT_FOUND = 6
"""NVML_ERROR_NOT_FOUND: no sample since the cursor."""
LISTS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
)


class Floor:
    """The calls a cycle on one GPU cannot do without, as cheaply as they can be made."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.samples = (pynvml.c_nvmlProcessUtilizationSample_t * ROOM)()
        self.lists = [(pynvml.c_nvmlProcessInfo_v3_t * ROOM)() for _ in LISTS]
        self.sampler = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
        self.listers = [pynvml._nvmlGetFunctionPointer(name) for name in LISTS]
        self.cursor = 0

    def __call__(self) -> None:
        count = ctypes.c_uint(ROOM)
        since = ctypes.c_ulonglong(self.cursor)
        code = self.sampler(self.handle, self.samples, ctypes.byref(count), since)
        if code not in (0, NOT_FOUND):
            raise pynvml.NVMLError(code)
        if code == 0 and count.value:
            self.cursor = max(self.samples[i].timeStamp for i in range(count.value))
        for lister, array in zip(self.listers, self.lists, strict=True):
            listed = ctypes.c_uint(ROOM)
            code = lister(self.handle, ctypes.byref(listed), array)
            if code != 0:
                raise pynvml.NVMLError(code)
        pynvml.nvmlDeviceGetMemoryInfo(self.handle, version=pynvml.nvmlMemory_v2)
        pynvml.nvmlDeviceGetUUID(self.handle)


DEFAULTS = AgentSettings.model_fields
REFRESH = timedelta(seconds=DEFAULTS["report_refresh"].default)
THRESHOLD_MIB = DEFAULTS["memory_threshold_mib"].default
"""The write rule as the default install runs it."""


def agent_cycle(reader: NodeReader) -> Callable[[], None]:
    """One cycle as the agent makes it: read, then decide on a write (the spec is built only
    for a write, which a steady node makes every report refresh; not timed here)."""
    published: list[Any] = [None, None]

    def cycle() -> None:
        now = datetime.now(UTC)
        new = reader.read().fingerprint()
        decision = decide(
            published[0], published[1], new, now, heartbeat=REFRESH, threshold_mib=THRESHOLD_MIB
        )
        if decision.write:
            published[:] = [new, now]

    return cycle


def timed(call: Callable[[], None]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": round(statistics.mean(ordered), 3),
        "p50": round(ordered[len(ordered) // 2], 3),
        "min": round(ordered[0], 3),
        "max": round(ordered[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--busy", type=float, default=0.5, help="each tenant's busy share")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between pairs")
    parser.add_argument("--output", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args()
    if (reason := no_gpu_reason()) is not None:
        sys.exit(f"agent_cycle_gpu: {reason}")
    tenants = Tenants()
    try:
        tenants.start_many(args.tenants, mib=64, busy=args.busy)
        pynvml.nvmlInit()
        floor = Floor(pynvml.nvmlDeviceGetHandleByIndex(0))
        reader = agent()
        cycle = agent_cycle(reader)
        sides: dict[str, list[tuple[float, float]]] = {"cycle": [], "floor": []}
        for pair in range(args.warmup + args.pairs):
            started = time.monotonic()
            order = [("cycle", cycle), ("floor", floor)]
            for name, call in order if pair % 2 == 0 else order[::-1]:
                took = timed(call)
                if pair >= args.warmup:
                    sides[name].append(took)
            time.sleep(max(0.0, args.every - (time.monotonic() - started)))
        reading = reader.read().reading
        listed = len(reading.processes_of(reading.gpus[0]))
        result: dict[str, Any] = {
            "gpu": pynvml.nvmlDeviceGetName(floor.handle),
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "tenants": args.tenants,
            "listed_processes": listed,
            "busy": args.busy,
            "pairs": args.pairs,
            "every_s": args.every,
            "python": sys.version.split()[0],
        }
        for unit, index in (("wall_ms", 0), ("cpu_ms", 1)):
            cycles = [took[index] for took in sides["cycle"]]
            floors = [took[index] for took in sides["floor"]]
            ratios = [c / f for c, f in zip(cycles, floors, strict=True) if f > 0]
            result[unit] = {
                "cycle": summary(cycles),
                "unavoidable": summary(floors),
                "ratio_of_means": round(statistics.mean(cycles) / statistics.mean(floors), 3),
                "ratio_p50_of_pairs": round(sorted(ratios)[len(ratios) // 2], 3),
            }
    finally:
        tenants.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
