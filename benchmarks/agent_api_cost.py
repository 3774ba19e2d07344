"""The agent's API cost per node, with the default settings and a steady workload.

One simulated hour of 10-second cycles (360) on 8 GPUs x 8 processes with allocator jitter of a
few MiB per cycle is offered to the real Publisher, which writes to a real local apiserver; the
clock is simulated, the writes are real. Then the agent itself runs as a process for 20 s with
8 x 64 processes to read its resident memory. Extrapolated to a 5,000-node cluster.

    python benchmarks/agent_api_cost.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests package (fake machines); gpuusage is installed

from gpuusage.kube.config import api_client  # noqa: E402
from gpuusage.kube.crds import install_crds  # noqa: E402
from gpuusage.kube.rest import RestClient  # noqa: E402
from gpuusage_dev.localcluster.cluster import LocalCluster  # noqa: E402
from gpuusage_dev.proctree import write_process  # noqa: E402
from gpuusage_nodeagent.gpusource.fake import FakeSource  # noqa: E402
from gpuusage_nodeagent.main import NodeReader  # noqa: E402
from gpuusage_nodeagent.metrics import AgentMetrics  # noqa: E402
from gpuusage_nodeagent.publisher import Publisher  # noqa: E402
from gpuusage_nodeagent.resolver import Resolver  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402
from tests.fakenvml import gpu_uuid  # noqa: E402

DEFAULTS = AgentSettings(node_name="x")
CYCLES = int(3600 / DEFAULTS.interval)
NODES = 5000


def scenario(path: Path, per_gpu: int, rng: random.Random) -> None:
    gpus = []
    pid = 10_000
    for index in range(8):
        procs = []
        for _ in range(per_gpu):
            used = 4096 + rng.randint(-8, 8)
            procs.append({"pid": pid, "usedMemoryMiB": used, "name": "python"})
            pid += 1
        utilization = {"gpu": rng.randint(0, 100), "memory": rng.randint(0, 100)}
        gpus.append(
            {
                "index": index,
                "uuid": gpu_uuid(index),
                "name": "NVIDIA H100 80GB HBM3",
                "memoryTotalMiB": 81559,
                "processes": procs,
                "utilization": utilization,
            }
        )
    path.write_text(yaml.safe_dump({"gpus": gpus}))


def proc_tree(root: Path, count: int) -> None:
    for n in range(count):
        cid = f"{n:064x}"
        pod = f"00000000-0000-4000-8000-{n:012x}"
        write_process(root, 10_000 + n, f"0::/kubepods/burstable/pod{pod}/{cid}\n")


def agent_rss(cluster: LocalCluster, work: Path, node: str) -> dict[str, float]:
    path = work / "big.yaml"
    scenario(path, 64, random.Random(3))
    proc = work / "proc-big"
    proc_tree(proc, 512)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuusage.cli",
            "agent",
            "--node-name",
            node,
            "--interval",
            "1",
            "--gpu-source",
            f"fake:{path}",
            "--proc-root",
            str(proc),
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--metrics-port",
            "0",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(20)
        status = Path(f"/proc/{agent.pid}/status").read_text()
        values = {
            line.split(":")[0]: line.split()[1]
            for line in status.splitlines()
            if line.startswith(("VmRSS:", "VmHWM:"))
        }
        usage = Path(f"/proc/{agent.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(usage[11]) + int(usage[12])) / os.sysconf("SC_CLK_TCK")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    return {
        "agent_rss_mib": round(int(values["VmRSS"]) / 1024, 1),
        "agent_peak_rss_mib": round(int(values["VmHWM"]) / 1024, 1),
        "agent_cpu_seconds_in_20s_incl_startup": round(cpu_s, 2),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cluster = LocalCluster(work / "cluster", tie_to_parent=True)
        cluster.up()
        try:
            api, _ = api_client(cluster.kubeconfig)
            install_crds(api)
            core = client.CoreV1Api(api)
            for name in ("bench-node", "bench-node-big"):
                core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
            path = work / "scenario.yaml"
            rng = random.Random(11)
            scenario(path, 8, rng)
            proc = work / "proc"
            proc_tree(proc, 64)
            now = datetime(2026, 11, 21, tzinfo=UTC)
            reader = NodeReader("bench-node", FakeSource(path), Resolver(proc), clock=lambda: now)
            metrics = AgentMetrics()
            rest, _ = RestClient.from_kubeconfig(cluster.kubeconfig)
            publisher = Publisher(
                rest,
                "bench-node",
                heartbeat=timedelta(seconds=DEFAULTS.heartbeat),
                threshold_mib=DEFAULTS.memory_threshold_mib,
                metrics=metrics,
            )
            for _ in range(CYCLES):
                scenario(path, 8, rng)  # jitter and utilization change every cycle
                publisher.offer(reader.read())
                now += timedelta(seconds=DEFAULTS.interval)
            registry = metrics.registry
            writes = sum(
                registry.get_sample_value("gpuusage_agent_api_writes_total", {"verb": verb}) or 0
                for verb in ("create", "patch")
            )
            per_hour_bytes = registry.get_sample_value("gpuusage_agent_api_write_bytes_total")
            rss = agent_rss(cluster, work, "bench-node-big")
        finally:
            cluster.down()
    result = {
        "settings": {
            "interval_s": DEFAULTS.interval,
            "heartbeat_s": DEFAULTS.heartbeat,
            "memory_threshold_mib": DEFAULTS.memory_threshold_mib,
        },
        "node": "8 GPUs x 8 processes, jitter +-8 MiB per cycle",
        "cycles_per_hour": CYCLES,
        "writes_per_node_hour": writes,
        "request_bytes_per_node_hour": per_hour_bytes,
        "bytes_per_write": per_hour_bytes // max(writes, 1),
        f"cluster_{NODES}_nodes_writes_per_second": round(writes * NODES / 3600, 1),
        f"cluster_{NODES}_nodes_request_kib_per_second": round(
            per_hour_bytes * NODES / 3600 / 1024, 1
        ),
        **rss,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
