"""Resident memory of the operator's pod index per pod it never marks.

The operator watches every pod in the cluster; most are not GPU pods, and what it keeps of each
must stay small. This creates realistic pods on the local control plane (three containers with
resources, env and probes; a status as the kubelet writes it, with container IDs, images,
conditions and IPs; labels, an owner and the managed fields of two writers), then lists them
into the operator's own pod index (informers.podwatch.PodWatch, the code the operator runs)
in a fresh process, and reads that process's resident memory before and after, with the index kept.

Printed, at each size: the resident memory the index added (from an empty cluster's list, so
the per-pod figure includes whatever the listing left behind), per pod; and between the two
sizes the marginal cost of one more pod. `--trace` adds the live Python heap (tracemalloc) by
allocation site, in a separate measurement.

    python benchmarks/pod_index_memory.py --pods 5000 --more 5000 [--trace]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client

from gpuusage.kube import raw
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_operator.informers.podwatch import PodWatch

NAMESPACES = 20
NODES = 200
CONTAINERS = ("main", "sidecar", "istio-proxy")


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def pod_spec(i: int) -> dict[str, Any]:
    ns = f"team-{i % NAMESPACES}"
    probe = {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"web-{i:06d}-{uuid.uuid4().hex[:5]}",
            "namespace": ns,
            "labels": {"app": "web", "pod-template-hash": "5d8f9c7b6d", "team": ns},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-25T09:00:00Z"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "web-5d8f9c7b6d",
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "nodeName": f"node-{i % NODES:03d}",
            "containers": [
                {
                    "name": name,
                    "image": f"registry.example.com/{name}:1.2.3",
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "128Mi"},
                        "limits": {"memory": "256Mi"},
                    },
                    "env": [{"name": "LOG_LEVEL", "value": "info"}],
                    "ports": [{"containerPort": 8080, "name": "http"}],
                    "readinessProbe": probe,
                    "livenessProbe": probe,
                }
                for name in CONTAINERS
            ],
        },
    }


def pod_status(uid: str, i: int) -> dict[str, Any]:
    when = "2026-11-25T10:00:05Z"
    return {
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": kind, "status": "True", "lastTransitionTime": when}
                for kind in (
                    "PodReadyToStartContainers",
                    "Initialized",
                    "Ready",
                    "ContainersReady",
                    "PodScheduled",
                )
            ],
            "hostIP": "10.0.0.1",
            "hostIPs": [{"ip": "10.0.0.1"}],
            "podIP": f"10.244.{i // 250 % 250}.{i % 250}",
            "podIPs": [{"ip": f"10.244.{i // 250 % 250}.{i % 250}"}],
            "startTime": "2026-11-25T10:00:00Z",
            "qosClass": "Burstable",
            "containerStatuses": [
                {
                    "name": name,
                    "state": {"running": {"startedAt": when}},
                    "ready": True,
                    "restartCount": 0,
                    "image": f"registry.example.com/{name}:1.2.3",
                    "imageID": "registry.example.com/app@sha256:"
                    + hashlib.sha256(name.encode()).hexdigest(),
                    "containerID": "containerd://"
                    + hashlib.sha256(f"{uid}/{name}".encode()).hexdigest(),
                    "started": True,
                }
                for name in CONTAINERS
            ],
        }
    }


def create_pods(core: client.CoreV1Api, first: int, count: int) -> None:
    def one(i: int) -> None:
        body = pod_spec(i)
        ns = body["metadata"]["namespace"]
        made = json.loads(raw.body(core.create_namespaced_pod(ns, body, _preload_content=False)))
        raw.body(
            core.patch_namespaced_pod_status(
                made["metadata"]["name"],
                ns,
                pod_status(made["metadata"]["uid"], i),
                field_manager="kubelet",
                _preload_content=False,
            )
        )

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(first, first + count)))


def measure(kubeconfig: str, trace: bool) -> None:
    """In a fresh process: the index's resident memory (and with trace, its live heap)."""
    api, _ = api_client(kubeconfig)
    core = client.CoreV1Api(api)
    # the client's connection and first request, outside the figure
    raw.body(core.list_pod_for_all_namespaces(limit=1, _preload_content=False))
    watch = PodWatch(core)
    gc.collect()
    before = resident_kib()
    if trace:
        tracemalloc.start(8)
        start = tracemalloc.take_snapshot()
    watch.list_all()
    gc.collect()
    after = resident_kib()
    result: dict[str, Any] = {"pods": len(watch), "added_kib": after - before}
    if trace:
        stats = tracemalloc.take_snapshot().compare_to(start, "lineno")
        result["heap_bytes"] = sum(s.size_diff for s in stats)
        result["sites"] = [
            [s.size_diff, f"{s.traceback[0].filename.rsplit('/', 1)[-1]}:{s.traceback[0].lineno}"]
            for s in stats[:8]
        ]
    print(json.dumps(result))


def run_measure(kubeconfig: str, trace: bool, code: Path | None = None) -> dict[str, Any]:
    """One measurement in a fresh process; `code`: another checkout whose operator is
    measured instead (its directories first on the path)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(code / d) for d in ("operator", "src"))
    found = subprocess.run(
        [sys.executable, __file__, "--measure", kubeconfig, *(["--trace"] if trace else [])],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    answer: dict[str, Any] = json.loads(found.stdout.strip().splitlines()[-1])
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--more", type=int, default=5000, help="pods added for the slope")
    parser.add_argument("--rounds", type=int, default=3, help="measurements at each size")
    parser.add_argument("--trace", action="store_true", help="also trace the live heap")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of another version (git worktree add DIR REV): measured side by side",
    )
    parser.add_argument("--measure", metavar="KUBECONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.trace)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        cluster.up()
        try:
            api, _ = api_client(cluster.kubeconfig)
            api.configuration.connection_pool_maxsize = 32
            core = client.CoreV1Api(api)
            for ns in range(NAMESPACES):
                ensure_namespace(core, f"team-{ns}")
            codes: dict[str, Path | None] = {"this checkout": None}
            if args.baseline is not None:
                codes["baseline"] = args.baseline.resolve()
            empty = {
                label: [run_measure(cluster.kubeconfig, False, code) for _ in range(args.rounds)]
                for label, code in codes.items()
            }
            sizes: list[tuple[int, dict[str, list[dict[str, Any]]]]] = []
            made = 0
            for count in (args.pods, args.more):
                started = time.monotonic()
                create_pods(core, made, count)
                made += count
                page = raw.body(core.list_pod_for_all_namespaces(limit=500, _preload_content=False))
                print(
                    f"created {made} pods ({time.monotonic() - started:.0f} s); "
                    f"{len(page) // 500} bytes of JSON a pod as listed",
                    flush=True,
                )
                rounds = {
                    label: [
                        run_measure(cluster.kubeconfig, False, code) for _ in range(args.rounds)
                    ]
                    for label, code in codes.items()
                }
                sizes.append((made, rounds))
            for label in codes:
                listed = [r["added_kib"] for r in empty[label]]
                base = min(listed)
                print(f"{label}: empty cluster: index added {listed} KiB")
                medians = []
                for pods, by_code in sizes:
                    added = sorted(r["added_kib"] for r in by_code[label])
                    median = added[len(added) // 2]
                    medians.append((pods, median))
                    print(
                        f"{label}: {pods} pods: index added {added} KiB; median {median} KiB, "
                        f"{(median - base) * 1024 / pods:.0f} B a pod over the empty list"
                    )
                (small, low), (large, high) = medians
                print(f"{label}: marginal: {(high - low) * 1024 / (large - small):.0f} B a pod")
            if args.trace:
                for label, code in codes.items():
                    traced = run_measure(cluster.kubeconfig, True, code)
                    print(f"{label}: live heap: {traced['heap_bytes'] / made:.0f} B a pod")
                    for size, site in traced["sites"]:
                        print(f"  {size / made:7.0f} B a pod  {site}")
        finally:
            cluster.down()


if __name__ == "__main__":
    main()
