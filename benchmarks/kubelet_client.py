"""What asking the kubelet costs the agent: resident memory and CPU per PodResources List call,
and, for the agent's client, per GetAllocatableResources call (asked with each List).

Each client runs in a process of its own that first imports the agent (its resident memory
before any client is the baseline), then lists the fake kubelet (the kubelet's own generated
code and gRPC server) `--calls` times. Clients: `h2` (the agent's own, HTTP/2 framing by h2)
and `grpcio` (the gRPC runtime's generic unary call, where the interpreter has grpcio), side by
side in one run.

    .venv/bin/python benchmarks/kubelet_client.py [--python /path/to/python-with-grpcio]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpuusage_dev.fakekubelet import FakeKubelet

REPO = Path(__file__).resolve().parents[1]
ROOTS = ["src", "operator", "nodeagent", "commands", "devtools"]

CHILD = r"""
import json, sys, time
from pathlib import Path

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

# The agent without its kubelet client: everything its main module imports but that.
import gpuusage.kube.rest, gpuusage_nodeagent.publisher, gpuusage_nodeagent.metrics
import gpuusage_nodeagent.gpusource.nvml, gpuusage_nodeagent.gpusource.fake
import gpuusage_nodeagent.resolver, gpuusage_nodeagent.report, gpuusage_nodeagent.caps
before = rss_kib()
client, socket, calls = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
import gpuusage_nodeagent.podresources.wire as wire
if client == "h2":
    import gpuusage_nodeagent.main  # the agent as it runs, with the client
    from gpuusage_nodeagent.podresources.kubelet import list_pods
    call = lambda: list_pods(socket, 5.0)
else:
    import grpc
    channel = grpc.insecure_channel(f"unix://{socket}")
    method = channel.unary_unary("/v1.PodResourcesLister/List")
    call = lambda: method(b"", timeout=5.0)
imported = rss_kib()
pods = 0
started = time.process_time()
for _ in range(calls):
    pods = len(wire.list_response(call()))
cpu = time.process_time() - started
allocatable = None
if client == "h2":
    from gpuusage_nodeagent.podresources.kubelet import list_allocatable
    started = time.process_time()
    for _ in range(calls):
        wire.allocatable_response(list_allocatable(socket, 5.0))
    allocatable = 1000 * (time.process_time() - started) / calls
print(json.dumps({"client": client, "baseline_kib": before, "imported_kib": imported,
                  "after_kib": rss_kib(), "cpu_ms_per_call": 1000 * cpu / calls, "pods": pods,
                  "cpu_ms_per_allocatable_call": allocatable}))
"""


def replica(i: int) -> str:
    """The i-th time-slicing replica of a node of 8 GPUs."""
    return f"GPU-{i % 8:08x}-1111-2222-3333-444444444444::{i // 8}"


def node_pods(gpu_pods: int, other_pods: int) -> list[dict[str, Any]]:
    """A busy node as the kubelet lists it: GPU pods with a device each, and other pods."""
    pods = []
    for i in range(gpu_pods):
        devices = [{"resource_name": "nvidia.com/gpu", "device_ids": [replica(i)]}]
        pods.append(
            {
                "name": f"train-{i}",
                "namespace": "ml",
                "containers": [{"name": "main", "devices": devices, "cpu_ids": [i]}],
            }
        )
    for i in range(other_pods):
        pods.append(
            {
                "name": f"web-{i}",
                "namespace": "default",
                "containers": [{"name": "web"}, {"name": "sidecar"}],
            }
        )
    return pods


def run(python: str, client: str, socket: Path, calls: int) -> dict[str, Any] | str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / r) for r in ROOTS)}
    proc = subprocess.run(
        [python, "-c", CHILD, client, str(socket), str(calls)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=300,
    )
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter for the clients")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--gpu-pods", type=int, default=32)
    parser.add_argument("--other-pods", type=int, default=78)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, FakeKubelet(Path(folder) / "kubelet.sock") as k:
        advertised = {"nvidia.com/gpu": [replica(i) for i in range(args.gpu_pods)]}
        k.pods(*node_pods(args.gpu_pods, args.other_pods), advertised=advertised)
        for client in ("h2", "grpcio"):
            result = run(args.python, client, k.socket, args.calls)
            if isinstance(result, str):
                print(f"{client}: not measured ({result})")
                continue
            print(
                f"{client}: agent baseline {result['baseline_kib'] / 1024:.1f} MiB, "
                f"+{(result['imported_kib'] - result['baseline_kib']) / 1024:.1f} MiB on import, "
                f"+{(result['after_kib'] - result['baseline_kib']) / 1024:.1f} MiB after "
                f"{args.calls} calls; {result['cpu_ms_per_call']:.2f} ms CPU per call "
                f"({result['pods']} pods listed)"
            )
            if result["cpu_ms_per_allocatable_call"] is not None:
                print(
                    f"{client}: {result['cpu_ms_per_allocatable_call']:.2f} ms CPU per "
                    f"GetAllocatableResources call ({args.gpu_pods} replicas advertised)"
                )


if __name__ == "__main__":
    main()
