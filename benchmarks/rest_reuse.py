"""What keeping the agent's TLS connection open saves, on both ends.

The agent's REST client against a real local kube-apiserver, sending what an agent sends most
(a Lease renewal: a merge patch of about 120 bytes), in rounds that alternate between the
client as it is (one connection kept open) and the client made to open a new connection for
every request (what it did before: a TLS handshake each time). Measured per request: the
client's CPU (process_time) and the apiserver's CPU (utime + stime of its process, from /proc),
side by side in one run, so the machine's drift cancels out in the ratios.

    .venv/bin/python benchmarks/rest_reuse.py --requests 300 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from gpuusage.kube.rest import RestClient
from gpuusage_dev.localcluster.cluster import ClusterState, LocalCluster

TICK = os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _round(rest: RestClient, pid: int, requests: int, reuse: bool) -> tuple[float, float]:
    """Client and apiserver CPU seconds per request, for one round."""
    path = "/apis/coordination.k8s.io/v1/namespaces/default/leases/bench"
    client0, server0 = time.process_time(), _server_cpu(pid)
    for n in range(requests):
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        rest.merge_patch(path, {"spec": {"renewTime": now, "leaseTransitions": n % 2}})
        if not reuse:
            rest.close_connection()
    return (
        (time.process_time() - client0) / requests,
        (_server_cpu(pid) - server0) / requests,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuusage-bench-") as work:
        cluster = LocalCluster(Path(work) / "cluster")
        cluster.up()
        try:
            state = ClusterState.load(cluster.state_path)
            assert state is not None
            pid = next(p.pid for p in state.processes if p.name == "kube-apiserver")
            rest, _ = RestClient.from_kubeconfig(cluster.kubeconfig)
            with rest:
                rest.post(
                    "/apis/coordination.k8s.io/v1/namespaces/default/leases",
                    {"metadata": {"name": "bench"}, "spec": {"holderIdentity": "bench"}},
                )
                _round(rest, pid, 50, True)  # warm both ends
                _round(rest, pid, 50, False)
                kept: list[tuple[float, float]] = []
                fresh: list[tuple[float, float]] = []
                for _ in range(args.rounds):
                    kept.append(_round(rest, pid, args.requests, True))
                    fresh.append(_round(rest, pid, args.requests, False))
                opened = rest.connections_opened
        finally:
            cluster.down()

    def ms(values: list[tuple[float, float]], i: int) -> float:
        return round(statistics.median(v[i] for v in values) * 1000, 3)

    print(
        json.dumps(
            {
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "connections_opened": opened,
                "client_cpu_ms_per_request": {"kept": ms(kept, 0), "new": ms(fresh, 0)},
                "apiserver_cpu_ms_per_request": {"kept": ms(kept, 1), "new": ms(fresh, 1)},
                "ratio_new_to_kept": {
                    "client": round(ms(fresh, 0) / ms(kept, 0), 2),
                    "apiserver": round(ms(fresh, 1) / max(ms(kept, 1), 1e-3), 2),
                },
                # 5,000 agents renew every 10 s: 500 requests a second reach the apiserver.
                "apiserver_cores_saved_at_5000_nodes": round(
                    (ms(fresh, 1) - ms(kept, 1)) / 1000 * 500, 3
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
