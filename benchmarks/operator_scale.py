"""The operator at 500 nodes / 5,000 pods on the local control plane.

Measures, with the operator running as its own process (`gpuusage operator --standalone`):

1. initial convergence: every pod annotated after the operator starts on 500 reports;
2. heartbeats: every report rewritten with only `observedAt` changed, then pod writes counted
   by the apiserver itself (`apiserver_request_total`, PATCH on pods and pods/status): target 0;
3. latency and throughput: reports changed at a fixed rate (a process's memory grows by a GiB,
   a step the pod's `gpu-memory-mib` annotation shows at once); the time from
   the spec PATCH returning to the annotation appearing on a pod watch, p50 and p99 (target
   p99 ≤ 2 s), at each rate in --rates (target: ≥ 50 updates/s sustained);
4. the operator's resident memory (VmRSS and its peak VmHWM; target ≤ 250 MB);
5. with --burst N: N reports changed at once (one pod's process on each grows by a GiB, as
   when a gang-scheduled job's processes allocate together), sent by 16 writers as fast as the
   apiserver takes them: the time until every one of those pods shows it, the operator's
   memory before and after, and whether anything was lost (every pod's annotation and every
   report's status checked afterwards).

    python benchmarks/operator_scale.py [--nodes 500] [--pods-per-node 10] [--rates 50,100]
    python benchmarks/operator_scale.py --nodes 5000 --pods-per-node 1 --rates "" --burst 1000
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests package (fake machines); gpuusage is installed

from gpuusage.api import names  # noqa: E402
from gpuusage.kube import raw  # noqa: E402
from gpuusage.kube.config import api_client  # noqa: E402
from gpuusage.kube.crds import install_crds  # noqa: E402
from gpuusage_dev.localcluster.cluster import ClusterState, LocalCluster  # noqa: E402
from gpuusage_dev.simulation import create_running_pod, ensure_namespace  # noqa: E402
from tests.fakenvml import gpu_uuid  # noqa: E402

NAMESPACES = 10
STEP_MIB = 1024
"""A process's growth: a quarter of its 4 GiB, a step the pod's annotation shows (the
operator holds back smaller moves, and moves within ten minutes of the detail shown:
writers.marks.held_detail; the reports are first written as observed eleven minutes ago)."""


class World:
    """The simulated cluster: nodes, pods, and the spec each node's agent last published."""

    def __init__(self, api: client.ApiClient, nodes: int, per_node: int) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.nodes = [f"gpu-{i:04d}" for i in range(nodes)]
        self.per_node = per_node
        self.specs: dict[str, dict[str, Any]] = {}
        self.pod_of: dict[tuple[str, int], str] = {}  # (node, process slot) → "ns/name"
        self.memory: dict[str, int] = {}  # "ns/name" → MiB the pod's process uses now

    def create(self, pool: ThreadPoolExecutor) -> None:
        for ns in range(NAMESPACES):
            ensure_namespace(self.core, f"bench-{ns}")
        list(pool.map(self._node, self.nodes))

    def _node(self, node: str) -> None:
        self.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
        processes: list[list[dict[str, Any]]] = [[] for _ in range(8)]
        for slot in range(self.per_node):
            ns = f"bench-{slot % NAMESPACES}"
            name = f"{node}-p{slot}"
            _uid, cid = create_running_pod(self.core, ns, name, node, "main")
            key = f"{ns}/{name}"
            self.pod_of[(node, slot)] = key
            self.memory[key] = 4096
            processes[slot % 8].append(
                {
                    "pid": 10_000 + slot,
                    "name": "python3",
                    "usedMemoryMiB": 4096,
                    "containerID": cid,
                    "types": ["compute"],
                }
            )
        gpus = [
            {
                "index": i,
                "uuid": gpu_uuid(i),
                "name": "NVIDIA H100 80GB HBM3",
                "memory": {"totalMiB": 81559, "usedMiB": sum(p["usedMemoryMiB"] for p in procs)},
                "processes": procs,
            }
            for i, procs in enumerate(processes)
        ]
        spec = {
            "nodeName": node,
            "observedAt": _now(ago=timedelta(minutes=11)),
            "gpus": gpus,
            "source": {"kind": "fake", "available": True},
        }
        self.specs[node] = spec
        body = {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "metadata": {"name": node},
            "spec": spec,
        }
        self.custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, body)

    def publish(self, node: str) -> None:
        self.specs[node]["observedAt"] = _now()
        self.custom.patch_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, node, {"spec": self.specs[node]}
        )

    def grow(self, node: str, slot: int) -> tuple[str, int]:
        """One process grows by STEP_MIB; returns (pod, its new annotation value)."""
        process = self.specs[node]["gpus"][slot % 8]["processes"][slot // 8]
        process["usedMemoryMiB"] += STEP_MIB
        gpu = self.specs[node]["gpus"][slot % 8]
        gpu["memory"]["usedMiB"] = sum(p["usedMemoryMiB"] for p in gpu["processes"])
        key = self.pod_of[(node, slot)]
        self.memory[key] = process["usedMemoryMiB"]
        return key, process["usedMemoryMiB"]


def _now(ago: timedelta = timedelta()) -> str:
    return (datetime.now(UTC) - ago).isoformat().replace("+00:00", "Z")


class PodWatch(threading.Thread):
    """Follows the pods' gpu-memory-mib annotation; wakes waiters when a value appears."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(daemon=True)
        self.core = client.CoreV1Api(api)
        self.values: dict[str, str] = {}
        # pod → (value, when its PATCH returned; None while the PATCH is still on its way)
        self.expected: dict[str, tuple[str, float | None]] = {}
        self.early: dict[str, float] = {}  # pod → when its value arrived before the PATCH returned
        self.arrived_early = 0
        self.latencies: list[float] = []
        self.lock = threading.Lock()
        self.version: str | None = None

    def run(self) -> None:
        while True:
            try:
                self._follow()
            except Exception as exc:  # a dropped stream: list again
                print(f"pod watch restarts: {exc!r}", file=sys.stderr)
                time.sleep(0.5)

    def _follow(self) -> None:
        """Raw watch lines, parsed as JSON only: deserialising 5,000 V1Pods would make this
        process compete with the operator for the CPU it is measuring. A broken stream resumes
        from the last resourceVersion: starting over would make the apiserver send all pods."""
        while True:
            response = self.core.list_pod_for_all_namespaces(
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=self.version,
                timeout_seconds=300,
                _preload_content=False,
            )
            for event in raw.json_lines(response):
                self.version = self._event(event, self.version)

    def _event(self, event: dict[str, Any], version: str | None) -> str | None:
        if event["type"] == "ERROR":
            return None  # e.g. 410 Gone: list again
        meta = event["object"]["metadata"]
        if event["type"] == "BOOKMARK":
            return str(meta["resourceVersion"])
        key = f"{meta['namespace']}/{meta['name']}"
        value = (meta.get("annotations") or {}).get(names.ANNOTATION_GPU_MEMORY_MIB)
        now = time.monotonic()
        with self.lock:
            if value is not None:
                self.values[key] = value
            wanted = self.expected.get(key)
            if wanted is not None and value == wanted[0]:
                del self.expected[key]
                if wanted[1] is None:
                    self.early[key] = now
                else:
                    self.latencies.append(now - wanted[1])
        return str(meta["resourceVersion"])

    def expect(self, pod: str, value: int) -> None:
        """Registered before the PATCH is sent: the operator can write the pod, and the watch
        deliver it, before the PATCH call returns here (with the expectation registered only
        afterwards, such an update was never matched and counted as not applied)."""
        with self.lock:
            self.expected[pod] = (str(value), None)

    def sent(self, pod: str, at: float) -> None:
        """The PATCH returned at `at`: latency counts from here, as the module says."""
        with self.lock:
            arrived = self.early.pop(pod, None)
            if arrived is not None:
                self.arrived_early += 1
                self.latencies.append(max(0.0, arrived - at))
            elif pod in self.expected:
                self.expected[pod] = (self.expected[pod][0], at)

    def annotated(self) -> int:
        with self.lock:
            return len(self.values)


def apiserver_requests(api: client.ApiClient) -> dict[str, float]:
    """Requests the apiserver served so far, by "VERB resource[/subresource]"."""
    response = api.call_api("GET", f"{api.configuration.host}/metrics")
    counts: dict[str, float] = {}
    for line in response.read().decode().splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(
            part.split("=", 1)
            for part in line[line.index("{") + 1 : line.index("}")].replace('"', "").split(",")
        )
        key = labels["resource"] + ("/" + labels["subresource"] if labels["subresource"] else "")
        key = f"{labels['verb']} {key}"
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def apiserver_writes(api: client.ApiClient) -> dict[str, float]:
    """PATCH requests the apiserver served so far, by resource/subresource."""
    return {
        k.split(" ", 1)[1]: v for k, v in apiserver_requests(api).items() if k.startswith("PATCH ")
    }


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> int:
    return int(after.get(key, 0) - before.get(key, 0))


def memory_of(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value, _unit = line.split()
            fields[name.rstrip(":")] = round(int(value) / 1024, 1)
    return fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (utime and stime of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def run_rate(
    world: World, watcher: PodWatch, pool: ThreadPoolExecutor, rate: float, seconds: float
) -> dict[str, Any]:
    """Change reports at `rate` per second for `seconds`; latency of each change to its pod."""
    with watcher.lock:
        watcher.latencies.clear()
        watcher.arrived_early = 0
    sent, late = 0, 0
    start = time.monotonic()
    slots = [(node, slot) for slot in range(world.per_node) for node in world.nodes]

    def send(node: str, slot: int) -> None:
        pod, value = world.grow(node, slot)
        watcher.expect(pod, value)
        world.publish(node)
        watcher.sent(pod, time.monotonic())

    futures = []
    while time.monotonic() - start < seconds:
        due = start + sent / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -1.0:
            late += 1
        node, slot = slots[sent % len(slots)]
        futures.append(pool.submit(send, node, slot))
        sent += 1
    for future in futures:
        future.result()
    achieved = sent / (time.monotonic() - start)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with watcher.lock:
            if not watcher.expected:
                break
        time.sleep(0.2)
    with watcher.lock:
        lat, missing, early = list(watcher.latencies), len(watcher.expected), watcher.arrived_early
        watcher.expected.clear()
    return {
        "rate_target": rate,
        "rate_sent": round(achieved, 1),
        "updates": sent,
        "applied": len(lat),
        "not_applied_after_60s": missing,
        "seen_before_the_patch_returned": early,
        "latency_p50_s": round(percentile(lat, 0.50), 3) if lat else None,
        "latency_p99_s": round(percentile(lat, 0.99), 3) if lat else None,
        "latency_max_s": round(max(lat), 3) if lat else None,
    }


def run_burst(
    world: World, watcher: PodWatch, pool: ThreadPoolExecutor, count: int, operator: int
) -> dict[str, Any]:
    """`count` reports, spread over the cluster, changed at once; then every one checked."""
    step = max(1, len(world.nodes) // count)
    nodes = world.nodes[::step][:count]
    memory_before = memory_of(operator)
    cpu_before = cpu_seconds(operator)
    with watcher.lock:
        watcher.latencies.clear()
    expected: dict[str, tuple[str, int]] = {}  # pod → (node, MiB)

    def send(node: str) -> None:
        pod, value = world.grow(node, 0)
        expected[pod] = (node, value)
        watcher.expect(pod, value)
        before = time.monotonic()  # here latency counts from the PATCH being sent
        world.publish(node)
        watcher.sent(pod, before)

    start = time.monotonic()
    list(pool.map(send, nodes))
    sent_in = time.monotonic() - start
    deadline = start + 300
    while time.monotonic() < deadline:
        with watcher.lock:
            if not watcher.expected:
                break
        time.sleep(0.05)
    every_pod = time.monotonic() - start
    with watcher.lock:
        latencies, missing = list(watcher.latencies), len(watcher.expected)
        watcher.expected.clear()
    cpu = cpu_seconds(operator) - cpu_before

    def status_shows(item: tuple[str, tuple[str, int]]) -> bool:
        pod, (node, mib) = item
        report = world.custom.get_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, node
        )
        assert isinstance(report, dict)
        status = report.get("status") or {}
        name = pod.split("/", 1)[1]
        return status.get("observedGeneration") == report["metadata"]["generation"] and any(
            p["name"] == name and p.get("usedMemoryMiB") == mib for p in status.get("pods", [])
        )

    statuses_right = sum(pool.map(status_shows, expected.items()))
    with watcher.lock:
        annotations_right = sum(
            watcher.values.get(pod) == str(mib) for pod, (_node, mib) in expected.items()
        )
    return {
        "reports_changed": len(nodes),
        "sent_in_s": round(sent_in, 2),
        "every_pod_shows_it_after_s": round(every_pod, 2) if not missing else None,
        "latency_p50_s": round(percentile(latencies, 0.5), 2) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 0.99), 2) if latencies else None,
        "not_applied_after_300s": missing,
        "annotations_right": annotations_right,
        "statuses_right": statuses_right,
        "operator_cpu_s": round(cpu, 1),
        "operator_memory_before_mib": memory_before,
        "operator_memory_after_mib": memory_of(operator),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods-per-node", type=int, default=10)
    parser.add_argument("--rates", default="50,100", help="CR updates per second to drive")
    parser.add_argument("--seconds", type=float, default=60.0, help="per rate")
    parser.add_argument(
        "--burst", type=int, default=0, help="then change this many reports at once"
    )
    parser.add_argument(
        "--apiserver-profiling",
        action="store_true",
        help="serve the apiserver's /debug/pprof (to see where its CPU goes)",
    )
    args = parser.parse_args()
    # Stopped with SIGTERM (timeout, kill): still stop the operator and the control plane.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"nodes": args.nodes, "pods": args.nodes * args.pods_per_node}
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--profiling=true"] if args.apiserver_profiling else []
        cluster = LocalCluster(Path(tmp) / "cluster", apiserver_args=extra)
        cluster.up()
        operator = None
        try:
            api, _ = api_client(cluster.kubeconfig)
            api.configuration.connection_pool_maxsize = 32
            install_crds(api)
            world = World(api, args.nodes, args.pods_per_node)
            pool = ThreadPoolExecutor(16)
            started = time.monotonic()
            world.create(pool)
            result["setup_s"] = round(time.monotonic() - started, 1)
            watcher = PodWatch(api)
            watcher.start()
            log = (Path(tmp) / "operator.log").open("w")
            started = time.monotonic()
            operator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuusage.cli",
                    "operator",
                    "--standalone",
                    "--kubeconfig",
                    str(cluster.kubeconfig),
                    "--stale-after",
                    "3600",
                ],
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            pods = args.nodes * args.pods_per_node
            while watcher.annotated() < pods:
                if time.monotonic() - started > 900 or operator.poll() is not None:
                    raise SystemExit(f"only {watcher.annotated()} of {pods} pods annotated")
                time.sleep(0.5)
            result["initial_convergence_s"] = round(time.monotonic() - started, 1)
            result["initial_operator_cpu_s"] = round(cpu_seconds(operator.pid), 1)
            result["operator_memory_after_start_mib"] = memory_of(operator.pid)

            time.sleep(5)
            before = apiserver_writes(api)
            started = time.monotonic()
            list(pool.map(world.publish, world.nodes))
            result["heartbeat_round_s"] = round(time.monotonic() - started, 1)
            time.sleep(15)
            after = apiserver_writes(api)
            result["heartbeats"] = {
                "reports_rewritten": args.nodes,
                "report_status_writes": _delta(after, before, "gpunodeusages/status"),
                "pod_writes": _delta(after, before, "pods") + _delta(after, before, "pods/status"),
            }
            result["rates"] = []
            state = ClusterState.load(cluster.state_path)
            assert state is not None
            pids = {p.name: p.pid for p in state.processes}
            pids["operator"], pids["benchmark"] = operator.pid, os.getpid()
            for rate in (float(r) for r in args.rates.split(",") if r.strip()):
                requests_before = apiserver_requests(api)
                before = apiserver_writes(api)
                cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
                started = time.monotonic()
                measured = run_rate(world, watcher, pool, rate, args.seconds)
                elapsed = time.monotonic() - started
                after = apiserver_writes(api)
                measured["operator_cpu_ms_per_update"] = round(
                    (cpu_seconds(operator.pid) - cpu["operator"]) * 1000 / measured["updates"], 2
                )
                measured["operator_memory_mib"] = memory_of(operator.pid)
                measured["cores_used"] = {
                    name: round((cpu_seconds(pid) - cpu[name]) / elapsed, 2)
                    for name, pid in pids.items()
                }
                measured["pod_writes"] = _delta(after, before, "pods") + _delta(
                    after, before, "pods/status"
                )
                requests_after = apiserver_requests(api)
                measured["requests_per_update"] = {
                    key: round((count - requests_before.get(key, 0)) / measured["updates"], 2)
                    for key, count in sorted(requests_after.items())
                    if count - requests_before.get(key, 0) >= measured["updates"] * 0.01
                }
                result["rates"].append(measured)
                print(json.dumps(measured), file=sys.stderr)
            if args.burst:
                result["burst"] = run_burst(world, watcher, pool, args.burst, operator.pid)
                print(json.dumps(result["burst"]), file=sys.stderr)
            result["operator_memory_end_mib"] = memory_of(operator.pid)
        finally:
            if operator is not None:
                operator.terminate()
                operator.wait(30)
            cluster.down()
    result["python"] = sys.version.split()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
