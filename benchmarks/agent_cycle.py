"""CPU time and RSS of one agent cycle: 8 GPUs x 64 processes on a realistic proc tree.

The cycle is the production path: NvmlSource over pynvml (its functions answered by a fake
DGX-like machine running the driver model), the pid resolver over a proc tree with
systemd/containerd cgroup files plus thousands of unrelated processes, the report builder and
the write decision against the last published report; cycles 10 s apart on the driver's clock
(the default --interval, at which the cycles' own sampler reads keep its ring from running
over, so there is no read between them).

With --driver-costs (the default) every NVML call takes what it took on the real driver
(driverfacts.CALL_COST_MS, measured on an H200 with driver 580.159.04), so the figures describe
a cycle on that driver; the benchmark then sets the cycle beside the driver calls no agent can
avoid (per GPU: one sampler read, the three process lists, one memory read, the UUID), as
`ratio_to_unavoidable` (target: at most 1.15). --no-driver-costs gives the agent's own cost
with the fake driver's Python emulation reported apart.

The listed processes are live ones (a `sleep` each, started by the benchmark); the resolver
tells them apart as the agent does, by a stat per pid of its stat file (see identity). Their
cgroup files are the proc tree's, laid out as the kubelet lays them.

With --share, the compute share's short sampler reads are made between cycles as the agent
makes them (share.ShareSchedule, every --share-read-every on average) and their CPU, the
driver's measured cost included, is reported per cycle and as a share of one core; the cycles
then include the share's fit, so their ratio to the unavoidable calls is the agent's with the
share on.

    python benchmarks/agent_cycle.py [--cycles 300] [--gpus 8] [--per-gpu 64] [--share]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pynvml
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests package (fake machines); gpuusage is installed

from gpuusage_dev.proctree import pod_cgroup, write_process  # noqa: E402
from gpuusage_nodeagent.change import decide  # noqa: E402
from gpuusage_nodeagent.driverfacts import call_cost_ms  # noqa: E402
from gpuusage_nodeagent.gpusource.nvml import NvmlSource  # noqa: E402
from gpuusage_nodeagent.main import NodeReader, settle_memory  # noqa: E402
from gpuusage_nodeagent.metrics import AgentMetrics  # noqa: E402
from gpuusage_nodeagent.resolver import Resolver  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402
from gpuusage_nodeagent.share import ShareSchedule  # noqa: E402
from tests.fakenvml import FakeMachine, dgx_h100  # noqa: E402

OTHER_PROCESSES = 3000
REFRESH = timedelta(seconds=AgentSettings.model_fields["report_refresh"].default)
SHARE_READ_EVERY: float = AgentSettings.model_fields["share_read_every"].default
"""After this an unchanged report is written again: 300 s in the default install (its Lease
shows the agent alive between writes)."""


def unavoidable_ms(gpus: int, per_gpu: int) -> float:
    """The real driver's cost of the calls a cycle cannot do without (see the docstring)."""
    per = (
        call_cost_ms("nvmlDeviceGetProcessUtilization", per_gpu)
        + 3 * call_cost_ms("process_list", per_gpu)
        + call_cost_ms("nvmlDeviceGetMemoryInfo", per_gpu)
        + call_cost_ms("nvmlDeviceGetUUID", per_gpu)
    )
    return gpus * per


class EmulationClock:
    """CPU time spent inside the fake driver's emulated C functions (process lists and
    utilization samples, written into the caller's arrays in Python). On a GPU node that work
    is the driver's, done in C; the benchmark reports it apart so that the agent's own cost can
    be read without it."""

    def __init__(self, machine: FakeMachine) -> None:
        self.seconds = 0.0
        self._lookup = machine._function_pointer

    def install(self, patch: pytest.MonkeyPatch) -> None:
        patch.setattr(pynvml, "_nvmlGetFunctionPointer", self._function_pointer)

    def _function_pointer(self, name: str) -> Callable[..., int]:
        emulated = self._lookup(name)

        def timed(*args: Any) -> int:
            start = time.process_time()
            try:
                return int(emulated(*args))
            finally:
                self.seconds += time.process_time() - start

        return timed


@contextmanager
def live_processes(count: int) -> Iterator[list[int]]:
    """The pids of `count` live processes, killed and reaped at the end."""
    started = [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]
    try:
        yield [child.pid for child in started]
    finally:
        for child in started:
            child.kill()
        for child in started:
            child.wait()


def build_proc_tree(root: Path, pids: Sequence[int]) -> None:
    """The listed pids' files, each a pod's container, and the rest of a busy node."""
    rng = random.Random(7)
    for pid in pids:
        pod = str(uuid.UUID(int=rng.getrandbits(128)))
        cgroup = pod_cgroup(pod, f"{rng.getrandbits(256):064x}")
        write_process(root, pid, cgroup, comm="python3", start_ticks=rng.randint(1, 10**7))
    taken = set(pids)
    others = (pid for pid in range(1_000_000, 2_000_000) if pid not in taken)
    for _, other in zip(range(OTHER_PROCESSES), others, strict=False):  # never read
        write_process(root, other, "0::/system.slice/x.service", comm="x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--gpus", type=int, default=8, choices=range(1, 9))
    parser.add_argument("--per-gpu", type=int, default=64, help="processes per GPU")
    parser.add_argument(
        "--driver-costs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each NVML call costs what it did on the real driver",
    )
    parser.add_argument(
        "--share",
        action="store_true",
        help="make the compute share's reads between cycles, as the agent does (2 s apart)",
    )
    parser.add_argument("--output", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        pytest.MonkeyPatch.context() as patch,
        live_processes(args.gpus * args.per_gpu) as pids,
    ):
        proc = Path(tmp)
        build_proc_tree(proc, pids)
        machine = dgx_h100(processes_per_gpu=args.per_gpu)
        machine.gpus = machine.gpus[: args.gpus]
        for process, pid in zip(
            (p for gpu in machine.gpus for p in gpu.processes), pids, strict=True
        ):
            process.pid = pid
        machine.costs = args.driver_costs
        machine.install(patch)
        emulation = EmulationClock(machine)
        emulation.install(patch)
        source = NvmlSource(pynvml, clock=machine.now)
        resolver = Resolver(proc)
        reader = NodeReader("gpu-node-1", source, resolver, clock=machine.now)
        metrics = AgentMetrics()
        published, published_at = None, None
        now = datetime(2026, 11, 21, tzinfo=UTC)
        cpu: list[float] = []
        driver: list[float] = []  # of which in the fake driver's emulated C functions
        shares: list[float] = []  # the share's reads between two cycles
        reads: list[int] = []
        schedule = ShareSchedule(SHARE_READ_EVERY, random.Random(3).random)
        clock = 0.0  # seconds on the driver's clock since the first cycle
        rng = random.Random(1)
        settle_memory()  # as the agent does before its first cycle
        for cycle in range(args.cycles + 20):
            for gpu in machine.gpus:  # allocator jitter of a few MiB on every process
                for p in gpu.processes:
                    p.used_mib = 4096 + rng.randint(-8, 8)
            spent, made, cycle_end = 0.0, 0, clock + 10
            while args.share and (due := schedule.next_at(clock)) < cycle_end:
                machine.tick(due - clock)
                clock = due
                schedule.read_at(due)
                began = time.process_time()
                reader.sample_shares()
                spent += time.process_time() - began
                made += 1
            machine.tick(cycle_end - clock)
            clock = cycle_end
            start, emulated = time.process_time(), emulation.seconds
            with metrics.cycle_seconds.time():
                attributed = reader.read()
            new = attributed.fingerprint()
            decision = decide(
                published, published_at, new, now, heartbeat=REFRESH, threshold_mib=64
            )
            if decision.write:  # the spec is built only for a write, as the publisher does
                spec = attributed.spec()
                published, published_at = new, now
            elapsed = time.process_time() - start
            now += timedelta(seconds=10)
            if cycle >= 20:  # after warm-up: caches filled, as in steady state
                cpu.append(elapsed * 1000)
                driver.append((emulation.seconds - emulated) * 1000)
                shares.append(spent * 1000)
                reads.append(made)
        processes = sum(len(g.processes) for g in spec.gpus)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu.sort()
    result = {
        "gpus": len(spec.gpus),
        "processes": processes,
        "cycles": len(cpu),
        "cpu_ms_mean": round(statistics.mean(cpu), 2),
        "cpu_ms_p50": round(cpu[len(cpu) // 2], 2),
        "cpu_ms_p99": round(cpu[int(len(cpu) * 0.99) - 1], 2),
        "max_rss_mib": round(rss_mib, 1),
        # the target: at most 1 % of a core at the default interval, at 8 x 64
        "percent_of_a_core_at_default_interval": round(
            statistics.mean(cpu) / (AgentSettings.model_fields["interval"].default * 1000) * 100,
            3,
        ),
        "python": sys.version.split()[0],
    }
    if args.share:
        result["share_reads_per_cycle_mean"] = round(statistics.mean(reads), 2)
        result["share_reads_cpu_ms_per_cycle_mean"] = round(statistics.mean(shares), 2)
        per_second = (statistics.mean(shares) + statistics.mean(cpu)) / 10
        result["cycle_and_share_percent_of_a_core"] = round(per_second / 10, 3)
        result["share_percent_of_a_core"] = round(statistics.mean(shares) / 100, 3)
    if args.driver_costs:
        floor = unavoidable_ms(len(spec.gpus), args.per_gpu)
        result["driver_costs"] = "measured (H200, driver 580.159.04)"
        result["unavoidable_driver_ms"] = round(floor, 2)
        result["ratio_to_unavoidable_mean"] = round(statistics.mean(cpu) / floor, 3)
        result["ratio_to_unavoidable_p50"] = round(cpu[len(cpu) // 2] / floor, 3)
    else:
        emulation_ms = statistics.mean(driver)
        result["of_which_driver_emulation_ms_mean"] = round(emulation_ms, 2)
        result["agent_ms_mean_without_emulation"] = round(statistics.mean(cpu) - emulation_ms, 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
