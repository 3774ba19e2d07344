"""Where the operator's memory goes: live Python objects against what the process holds.

The operator runs in this process on a world of `--nodes` reports with `--pods-per-node` pods
each (operator_scale's World, on the local control plane, built and watched by a child
process: memory freed after building it would otherwise be reused by the operator and hidden
from the figure) until every pod is annotated. The resident figure starts from the process
with every module imported: see operator_scale for the operator's whole process.
Printed: the resident memory it added, sampled while it converged, and with --trace the growth
of the live Python heap (tracemalloc, which slows the run several times and inflates the
resident figure, so the two are measured in separate runs), by file and by allocation site.
Comparing worlds with the same pods and more reports separates what a report costs from what
a pod costs. With --sizes, the deep size of each of the operator's structures once converged
(objects shared by two structures are counted in each). With --malloc, who holds the resident
pages once converged: the mappings by kind, glibc's heap (in use and free) and pymalloc's
arenas (blocks in use and free), which tells the live state from what the allocators keep.

    python benchmarks/operator_memory.py --nodes 2000 --pods-per-node 1
    python benchmarks/operator_memory.py --nodes 500 --pods-per-node 4 --trace
    python benchmarks/operator_memory.py --nodes 2000 --pods-per-node 1 --sizes
    python benchmarks/operator_memory.py --nodes 5000 --pods-per-node 1 --malloc
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import operator_scale as scale

from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crds
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_operator.main import Operator
from gpuusage_operator.settings import OperatorSettings


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def report_heap(before: tracemalloc.Snapshot, nodes: int, pods: int) -> None:
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    after = tracemalloc.take_snapshot().filter_traces(ignore)
    before = before.filter_traces(ignore)
    total = sum(s.size_diff for s in after.compare_to(before, "filename"))
    _, peak = tracemalloc.get_traced_memory()
    at_start = sum(stat.size for stat in before.statistics("filename"))
    print(
        f"live heap growth {total / 2**20:.1f} MiB: {total / nodes / 1024:.1f} kB a report, "
        f"{total / pods / 1024:.1f} kB a pod; its peak while converging "
        f"{(peak - at_start) / 2**20:.1f} MiB above the start"
    )
    print("by file:")
    for stat in after.compare_to(before, "filename")[:12]:
        print(f"  {stat.size_diff / 2**20:7.2f} MiB  {stat.traceback[0].filename}")
    print("by allocation site:")
    for stat in after.compare_to(before, "traceback")[:8]:
        frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stat.traceback][-5:]
        print(f"  {stat.size_diff / 2**20:7.2f} MiB  {' < '.join(reversed(frames))}")


def deep_size(obj: object, seen: set[int]) -> int:
    """The bytes of an object and of everything it holds that `seen` has not counted yet
    (classes, functions and modules are not counted: they are shared by all)."""
    stack, total = [obj], 0
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, type | type(sys) | type(main)):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif not isinstance(item, str | bytes | int | float):
            if hasattr(item, "__dict__"):
                stack.append(vars(item))
            for slot in getattr(type(item), "__slots__", ()):
                if hasattr(item, slot):
                    stack.append(getattr(item, slot))
    return total


def report_sizes(name: str, obj: object, reports: int, level: int = 0) -> None:
    """Each structure over 100 kB, three levels down, with its bytes a report."""
    size = deep_size(obj, set())
    if size < 100_000:
        return
    print(f"{'  ' * level}{name}: {size / 2**20:.2f} MiB, {size / reports:.0f} B a report")
    if level < 3 and hasattr(obj, "__dict__"):
        for key, value in sorted(vars(obj).items()):
            report_sizes(key, value, reports, level + 1)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def report_allocators() -> None:
    """Who holds the resident pages: the mappings by kind (smaps), glibc's heap in use and
    free (mallinfo2), and pymalloc's arenas (in use and free, from sys._debugmallocstats)."""
    kinds: dict[str, int] = {}
    kind = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            path = head[5] if len(head) > 5 else ""
            kind = (
                "heap"
                if path == "[heap]"
                else "stack"
                if "stack" in path
                else ("file" if path.startswith("/") else "anonymous")
            )
        elif head[0] == "Rss:":
            kinds[kind] = kinds.get(kind, 0) + int(head[1])
    print("resident by mapping: " + ", ".join(f"{k} {v / 1024:.1f} MiB" for k, v in kinds.items()))
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    print(
        f"glibc: heap {info.arena / 2**20:.1f} MiB ({info.uordblks / 2**20:.1f} in use, "
        f"{info.fordblks / 2**20:.1f} free), mmapped {info.hblkhd / 2**20:.1f} MiB"
    )
    with tempfile.TemporaryFile("w+") as out:  # it writes to the C stderr
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        stats = out.read()
    wanted = ("arenas allocated current", "bytes in allocated blocks", "bytes in available")
    for line in stats.splitlines():
        if line.startswith("#") and any(w in line for w in wanted):
            print("pymalloc:", " ".join(line[1:].split()))


def build_world(
    kubeconfig: Path, nodes: int, pods_per_node: int, built: Any, annotated: Any
) -> None:
    """In a child process: the world, then the count of annotated pods, kept in `annotated`
    (so that neither what building it allocated nor the watch's own memory is counted as the
    operator's)."""
    api, _ = api_client(kubeconfig)
    api.configuration.connection_pool_maxsize = 32
    install_crds(api)
    scale.World(api, nodes, pods_per_node).create(ThreadPoolExecutor(16))
    watcher = scale.PodWatch(api)
    watcher.start()
    built.set()
    while True:
        annotated.value = watcher.annotated()
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--pods-per-node", type=int, default=1)
    parser.add_argument("--trace", action="store_true", help="also trace the live heap")
    parser.add_argument("--sizes", action="store_true", help="the structures' deep sizes")
    parser.add_argument("--workers", type=int, default=16, help="the operator's --workers")
    parser.add_argument("--malloc", action="store_true", help="pymalloc's arenas and pools")
    args = parser.parse_args()
    pods = args.nodes * args.pods_per_node
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        cluster.up()
        try:
            fork = multiprocessing.get_context("fork")
            built, annotated = fork.Event(), fork.Value("i", 0)
            world = fork.Process(
                target=build_world,
                args=(cluster.kubeconfig, args.nodes, args.pods_per_node, built, annotated),
                daemon=True,
            )
            world.start()
            while not built.wait(1.0):
                if not world.is_alive():
                    raise SystemExit("the world could not be built")
            gc.collect()
            start_mib = resident_mib()
            before = None
            if args.trace:
                tracemalloc.start(12)
                before = tracemalloc.take_snapshot()
            stop, ready = threading.Event(), threading.Event()
            settings = OperatorSettings(
                kubeconfig=cluster.kubeconfig,
                standalone=True,
                stale_after=3600,
                workers=args.workers,
            )
            operator = Operator(settings)
            thread = threading.Thread(target=operator.run, args=(stop, ready), daemon=True)
            started = time.monotonic()
            thread.start()
            samples = []
            while annotated.value < pods:
                if time.monotonic() - started > 900:
                    raise SystemExit(f"only {annotated.value} of {pods} pods annotated")
                elapsed = time.monotonic() - started
                samples.append(f"{elapsed:.0f}s:{resident_mib() - start_mib:.0f}")
                time.sleep(1.0)
            converged = time.monotonic() - started
            time.sleep(10)  # the last writes' answers, the housekeeping pass
            gc.collect()
            print(f"{args.nodes} reports, {pods} pods: converged in {converged:.0f} s")
            print(f"resident memory added (MiB) while converging: {' '.join(samples)}")
            print(f"resident memory added at the end: {resident_mib() - start_mib:.1f} MiB")
            if before is not None:
                report_heap(before, args.nodes, pods)
            if args.sizes:
                report_sizes("operator", operator, args.nodes)
            if args.malloc:
                report_allocators()
            stop.set()
            thread.join(30)
            world.terminate()
        finally:
            cluster.down()


if __name__ == "__main__":
    main()
