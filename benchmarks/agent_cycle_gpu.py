"""The agent's cycle on a real GPU and driver, beside the driver calls no cycle can avoid.

`agent_cycle.py` charges each NVML call what it was measured to cost; this one measures both
sides on the real driver, in one run, interleaved: real CUDA tenants (tests.gpu.tenant, the
real-GPU suite's) share GPU 0, and each pair times one agent cycle (NVML, the pid resolver on
the host's /proc, the report's fingerprint and the write rule) and one round of the bare calls
(one sampler read from its own cursor, the three process lists, memory, UUID), made through
ctypes into arrays allocated beforehand, so that nothing of the agent's is in the floor. The
order within a pair alternates, so that drift falls on both sides alike.

Two sides take turns: the agent's cycle as it runs and the bare calls. After the pairs,
`--breakdown` cycles more, with every NVML call the cycle makes timed and the cycle's stages
timed apart, to show where the agent's own share goes.

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

from gpuusage_nodeagent import main as agent_main  # noqa: E402
from gpuusage_nodeagent.change import decide  # noqa: E402
from gpuusage_nodeagent.main import NodeReader, settle_memory  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402
from tests.gpu.machine import Tenants, agent, no_gpu_reason  # noqa: E402

PROC = Path("/proc")
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
        self.memory, self.uuid = pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetUUID
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
        self.memory(self.handle, version=pynvml.nvmlMemory_v2)
        self.uuid(self.handle)


DEFAULTS = AgentSettings.model_fields
REFRESH = timedelta(seconds=DEFAULTS["report_refresh"].default)
THRESHOLD_MIB = DEFAULTS["memory_threshold_mib"].default
"""The write rule as the default install runs it."""


class CallTimer:
    """Times the callables it patches in place, outermost calls only (a pynvml wrapper's own C
    call is inside it): wall ms and calls, by name, until `remove`."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1000
                self.calls[name] = self.calls.get(name, 0) + 1
                self._depth -= 1

        return call

    def patch(self, owner: Any, attribute: str, name: str) -> None:
        """Time `owner.attribute` under `name`."""
        fn = getattr(owner, attribute)
        self._saved.append((owner, attribute, fn))
        setattr(owner, attribute, self._timed(name, fn))

    def install_nvml(self) -> None:
        """Time every pynvml function, and every C function looked up meanwhile."""
        for name in dir(pynvml):
            fn = getattr(pynvml, name)
            if name.startswith("nvml") and callable(fn) and not isinstance(fn, type):
                self.patch(pynvml, name, name)
        lookup = pynvml._nvmlGetFunctionPointer
        self._saved.append((pynvml, "_nvmlGetFunctionPointer", lookup))
        pynvml._nvmlGetFunctionPointer = lambda symbol: self._timed(symbol, lookup(symbol))

    def remove(self) -> None:
        for owner, attribute, fn in reversed(self._saved):
            setattr(owner, attribute, fn)
        self._saved = []


def breakdown(reader: NodeReader, handle: Any, cycles: int, every: float) -> dict[str, Any]:
    """Where the time of the benchmark's own cycle (agent_cycle) goes: the NVML calls (ms and
    calls per cycle), and its stages (wall ms per cycle): `read` the source's reading with the
    visibility rule and the caps, of which `read_python` is outside the calls; `resolve`,
    `activity`; `write_rule` the rest (the fingerprint and the write rule). The bare calls are
    timed too, each cycle before the agent's (`floor_nvml_ms`), so that the two sides' calls
    compare under the same conditions."""
    floor_timer, timer, stages = CallTimer(), CallTimer(), CallTimer()
    floor_timer.install_nvml()
    floor = Floor(handle)  # its function pointers, timed
    floor_timer.remove()
    cycle, total = agent_cycle(reader), 0.0
    for owner, attribute, stage in (
        (reader.source, "read", "read"),
        (agent_main, "with_blind_devices", "read"),
        (agent_main, "capped", "read"),
        (reader.resolver, "resolve_all", "resolve"),
        (reader.resolver, "end_cycle", "resolve"),
        (agent_main, "judge_activity", "activity"),
    ):
        stages.patch(owner, attribute, stage)
    timer.install_nvml()
    try:
        for _ in range(cycles):
            started = time.monotonic()
            floor()
            total += timed(cycle)[0]
            time.sleep(max(0.0, every - (time.monotonic() - started)))
    finally:
        timer.remove()
        stages.remove()
    per_cycle = {name: ms / cycles for name, ms in stages.ms.items()}
    per_cycle["write_rule"] = total / cycles - sum(per_cycle.values())
    per_cycle["read_python"] = per_cycle["read"] - sum(timer.ms.values()) / cycles
    result: dict[str, Any] = {"cycles": cycles}
    result["stages_ms"] = {name: round(ms, 3) for name, ms in per_cycle.items()}
    for key, timing in (("nvml_ms", timer), ("floor_nvml_ms", floor_timer)):
        result[key] = {
            name: {"ms": round(ms / cycles, 4), "calls": round(timing.calls[name] / cycles, 2)}
            for name, ms in sorted(timing.ms.items(), key=lambda kv: -kv[1])
        }
    return result


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
    parser.add_argument("--breakdown", type=int, default=20, help="cycles timed call by call")
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
        calls: list[tuple[str, Callable[[], None]]] = [
            ("cycle", agent_cycle(reader)),
            ("floor", floor),
        ]
        sides: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in calls}
        settle_memory()  # as the agent does before its first cycle
        for pair in range(args.warmup + args.pairs):
            started = time.monotonic()
            turn = pair % len(calls)  # each side first, second and last in turn
            for name, call in calls[turn:] + calls[:turn]:
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
            floors = [took[index] for took in sides["floor"]]
            result[unit] = {"unavoidable": summary(floors)}
            cycles = [took[index] for took in sides["cycle"]]
            ratios = [c / f for c, f in zip(cycles, floors, strict=True) if f > 0]
            result[unit]["cycle"] = summary(cycles)
            result[unit]["cycle_ratio_of_means"] = round(
                statistics.mean(cycles) / statistics.mean(floors), 3
            )
            result[unit]["cycle_ratio_p50_of_pairs"] = round(sorted(ratios)[len(ratios) // 2], 3)
        if args.breakdown:
            result["breakdown"] = breakdown(reader, floor.handle, args.breakdown, args.every)
    finally:
        tenants.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
