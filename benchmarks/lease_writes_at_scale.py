"""The agents' Lease writes against the kubelets' node Lease writes, side by side at N simulated
nodes (5,000 by default) on one local control plane, counted by the apiserver itself.

Each simulated node has two heartbeats, written for real on a simulated clock that steps by the
agent's default --interval (10 s):

- **the kubelet's**: its Lease in kube-node-lease, updated whole every 10 s on the version it
  last wrote (as the kubelet's lease controller does);
- **the agent's**: the agent's own `LeaseRenewer` at its defaults (60 s, renewed every third),
  offered every cycle, as the agent's loop offers it after each cycle that read the node.

The window is `--seconds` of simulated time after both Leases exist (their creation is not
counted). Writes are the apiserver's `apiserver_request_body_size_bytes_count` for `leases` by
verb: the kubelets update (PUT), the agents patch. Threads share the nodes between them, each
with its own connection.

    python benchmarks/lease_writes_at_scale.py [--nodes 5000] [--seconds 120] [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuusage.api.times import format_micro_time  # noqa: E402
from gpuusage.kube.rest import RestClient  # noqa: E402
from gpuusage_dev.localcluster.cluster import LocalCluster  # noqa: E402
from gpuusage_dev.simulation import ensure_namespace  # noqa: E402
from gpuusage_nodeagent.lease import LeaseRenewer  # noqa: E402
from gpuusage_nodeagent.metrics import AgentMetrics  # noqa: E402
from gpuusage_nodeagent.publisher import WRITE_BACKOFF  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402

AGENTS_NS = "gpuusage-system"
KUBELET_EVERY = 10.0  # seconds: the kubelet's node Lease renewal (a quarter of its 40 s)
DEFAULTS = AgentSettings(node_name="x")
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
QUIET = (
    "--feature-gates=APIServerIdentity=false,UnknownVersionInteroperabilityProxy=false",
    "--endpoint-reconciler-type=none",
)
"""The apiserver's own Lease and Endpoints writes off: only the simulated nodes' count."""
KUBELET_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


def lease_writes(api: Any) -> dict[str, float]:
    """The apiserver's count of write requests on leases, by verb (`api`: a kubernetes
    ApiClient)."""
    text = api.call_api("GET", f"{api.configuration.host}/metrics").read().decode()
    found: dict[str, float] = {}
    prefix = "apiserver_request_body_size_bytes_count{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        labels = dict(p.split("=", 1) for p in name[len(prefix) : -1].replace('"', "").split(","))
        if labels.get("resource") == "leases":
            found[labels["verb"]] = found.get(labels["verb"], 0.0) + float(value)
    return found


def kubelet_lease(node: str, now: datetime, version: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": node, "namespace": "kube-node-lease"}
    if version:
        meta["resourceVersion"] = version
    spec = {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": format_micro_time(now)}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


class Nodes:
    """One thread's share of the simulated nodes: their kubelets' and agents' heartbeats."""

    def __init__(self, kubeconfig: Path, names: list[str], owner: dict[str, Any]) -> None:
        self.rest, _ = RestClient.from_kubeconfig(kubeconfig)
        self.names = names
        self.versions: dict[str, str] = {}
        self.renewers: dict[str, LeaseRenewer] = {}
        metrics = AgentMetrics()
        for name in names:
            renewer = LeaseRenewer(
                self.rest,
                AGENTS_NS,
                name,
                metrics=metrics,
                backoff=WRITE_BACKOFF,
                duration=timedelta(seconds=DEFAULTS.lease_duration),
                holder=f"gpuusage-agent/{name}",
            )
            renewer._owner.reference = lambda: owner  # type: ignore[method-assign]
            self.renewers[name] = renewer

    def create(self) -> None:
        for name in self.names:
            created = self.rest.post(KUBELET_LEASES, kubelet_lease(name, T0, None))
            self.versions[name] = created["metadata"]["resourceVersion"]
            self.renewers[name].renew_if_due(T0)

    def run(self, seconds: float) -> None:
        steps = int(seconds / DEFAULTS.interval)
        for step in range(1, steps + 1):
            now = T0 + timedelta(seconds=DEFAULTS.interval * step)
            kubelet_due = (DEFAULTS.interval * step) % KUBELET_EVERY == 0
            for name in self.names:
                if kubelet_due:
                    body = kubelet_lease(name, now, self.versions[name])
                    updated = self.rest.request("PUT", f"{KUBELET_LEASES}/{name}", body)
                    self.versions[name] = updated["metadata"]["resourceVersion"]
                self.renewers[name].renew_if_due(now)


def in_threads(shares: list[Nodes], work: str, *args: float) -> float:
    """Run `work` on every share at once; the seconds it took."""
    started = time.monotonic()
    threads = [threading.Thread(target=getattr(s, work), args=args) for s in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuusage-leases-") as folder:
        cluster = LocalCluster(Path(folder) / "cluster", apiserver_args=list(QUIET))
        cluster.up()
        try:
            from kubernetes import client  # noqa: PLC0415

            from gpuusage.kube.config import api_client  # noqa: PLC0415

            api, _ = api_client(cluster.kubeconfig)
            core = client.CoreV1Api(api)
            ensure_namespace(core, AGENTS_NS)
            node: Any = core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="n0")))
            owner = {"apiVersion": "v1", "kind": "Node", "name": "n0", "uid": node.metadata.uid}
            names = [f"gpu-node-{i:05d}" for i in range(args.nodes)]
            shares = [
                Nodes(cluster.kubeconfig, names[i :: args.threads], owner)
                for i in range(args.threads)
            ]
            created_in = in_threads(shares, "create")
            before = lease_writes(api)
            ran_in = in_threads(shares, "run", args.seconds)
            after = lease_writes(api)
        finally:
            cluster.down()
    kubelets = after.get("update", 0.0) - before.get("update", 0.0)
    agents = after.get("patch", 0.0) - before.get("patch", 0.0)
    per_hour = 3600 / args.seconds / args.nodes
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "simulated_seconds": args.seconds,
                "agent_interval_s": DEFAULTS.interval,
                "agent_lease_s": DEFAULTS.lease_duration,
                "kubelet_lease_writes": int(kubelets),
                "agent_lease_writes": int(agents),
                "kubelet_writes_per_second": round(kubelets / args.seconds, 1),
                "agent_writes_per_second": round(agents / args.seconds, 1),
                "kubelet_writes_per_node_hour": round(kubelets * per_hour, 1),
                "agent_writes_per_node_hour": round(agents * per_hour, 1),
                "agents_over_kubelets": round(agents / kubelets, 3) if kubelets else None,
                "created_in_s": round(created_in, 1),
                "window_wall_s": round(ran_in, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
