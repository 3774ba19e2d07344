"""What a Lease renewal costs the operator: CPU per watch event of the agents' Leases.

Every agent renews its Lease every 10 s, so at N nodes the operator's Lease informer receives
N/10 events a second whatever the GPUs do. This runs the informer's own watch loop (the
production `Informer` and `LeaseState`) over a stream of renewals as the apiserver sends them
(one JSON line per event, a Lease as the agent's is stored: owner reference, managed fields),
answered in-process, and reports CPU per event.

    python benchmarks/lease_events.py [--nodes 5000] [--events 200000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from gpuusage.api.times import format_micro_time
from gpuusage_operator.informers.leases import LeaseWatch

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def lease(node: str, version: int, renewed: datetime) -> dict[str, Any]:
    """A node agent's Lease as a watch event carries it."""
    return {
        "kind": "Lease",
        "apiVersion": "coordination.k8s.io/v1",
        "metadata": {
            "name": node,
            "namespace": "gpuusage-system",
            "uid": "01afef0f-7a1e-473f-a4ff-b04556a03506",
            "resourceVersion": str(version),
            "creationTimestamp": "2026-11-24T09:32:56Z",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": node,
                    "uid": "3ff5ae4c-0552-4b3a-afd6-14972cfc32d2",
                }
            ],
            "managedFields": [
                {
                    "manager": "Python-urllib",
                    "operation": "Update",
                    "apiVersion": "coordination.k8s.io/v1",
                    "time": "2026-11-24T09:33:00Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {
                        "f:spec": {
                            "f:acquireTime": {},
                            "f:holderIdentity": {},
                            "f:leaseDurationSeconds": {},
                            "f:renewTime": {},
                        }
                    },
                }
            ],
        },
        "spec": {
            "holderIdentity": f"gpuusage-agent/{node}",
            "leaseDurationSeconds": 40,
            "acquireTime": format_micro_time(T0),
            "renewTime": format_micro_time(renewed),
        },
    }


class Stream:
    """A watch response: the events in chunks, as urllib3 streams them."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, chunk: int, decode_content: bool = True) -> Iterator[bytes]:
        for start in range(0, len(self.data), chunk):
            yield self.data[start : start + chunk]

    def release_conn(self) -> None:
        pass


class Leases:
    """list_namespaced_lease as the apiserver answers it: an empty list, then one watch."""

    def __init__(self, watch: bytes) -> None:
        self.watch = watch

    def list_namespaced_lease(self, namespace: str, **kwargs: Any) -> Any:
        if kwargs.get("watch"):
            return Stream(self.watch)
        page = {"metadata": {"resourceVersion": "1"}, "items": []}
        return SimpleNamespace(data=json.dumps(page).encode(), release_conn=lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    nodes = [f"gpu-{i:05d}" for i in range(args.nodes)]
    lines = []
    for n in range(args.events):
        renewed = T0 + timedelta(seconds=10 * (n // args.nodes), microseconds=n)
        event = {"type": "MODIFIED", "object": lease(nodes[n % args.nodes], 2 + n, renewed)}
        lines.append(json.dumps(event, separators=(",", ":")))
    data = ("\n".join(lines) + "\n").encode()
    news: list[set[str]] = []
    watch = LeaseWatch(Leases(data), "gpuusage-system", on_news=news.append)
    informer = watch.informer
    version = informer.list_all()
    started, wall = time.process_time(), time.perf_counter()
    informer._watch(version)
    cpu = time.process_time() - started
    elapsed = time.perf_counter() - wall
    renewals = sum(1 for node in nodes if (seen := watch._memory.get(node)) and seen.witnessed)
    print(
        json.dumps(
            {
                "events": args.events,
                "event_bytes": len(data) // args.events,
                "cpu_us_per_event": round(cpu / args.events * 1e6, 1),
                "wall_s": round(elapsed, 2),
                "nodes_seen_renewing": renewals,
                "at_5000_nodes_core_share": round(cpu / args.events * 500, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
