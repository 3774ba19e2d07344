"""What a Lease renewal costs the operator: CPU per watch event of the agents' Leases.

Every agent renews its Lease every 20 s, so at N nodes the operator's Lease informer receives
N/20 events a second whatever the GPUs do. This runs the informer's own watch loop (the
production `Informer` and `LeaseState`) over a stream of renewals as the apiserver sends them
(one JSON line per event, a Lease as the agent's is stored: owner reference, managed fields),
answered in-process, and reports CPU per event (all threads).

Three ways in one run, side by side, each with a production worker thread (ReportWorkers) over
a reconciler that has seen every report fresh: the watch alone; the watch as the operator wires
it (Liveness.renewed: a renewal is queued only for a report judged stale); and every
renewal queued, taken by the worker, found to change nothing (the design that avoids). With
`--rate` the events come paced, as a fleet sends them, so that each queued one wakes the worker
(unpaced, the queue coalesces them and hides that cost).

    python benchmarks/lease_events.py [--nodes 5000] [--events 200000] [--rate 0]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

from kubernetes import client

from gpuusage.api.times import format_micro_time
from gpuusage_operator.controller.debounce import Debounce
from gpuusage_operator.controller.reconcile import Counts, Reconciler
from gpuusage_operator.controller.term import Term, new_terms
from gpuusage_operator.controller.triggers import RENEWED, Triggers
from gpuusage_operator.controller.workers import ReportWorkers
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.ha.leader import ActiveGate
from gpuusage_operator.ha.terms import Terms
from gpuusage_operator.informers.leasewatch import LeaseWatch
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.podmarker import pod_writer

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


class PacedStream(Stream):
    """The events one line at a time, `rate` a second."""

    def __init__(self, data: bytes, rate: float) -> None:
        super().__init__(data)
        self.rate = rate

    def stream(self, chunk: int, decode_content: bool = True) -> Iterator[bytes]:
        started = time.perf_counter()
        for n, line in enumerate(self.data.splitlines(keepends=True)):
            ahead = started + n / self.rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            yield line


class PacedLeases(Leases):
    def __init__(self, watch: bytes, rate: float) -> None:
        super().__init__(watch)
        self.rate = rate

    def list_namespaced_lease(self, namespace: str, **kwargs: Any) -> Any:
        if kwargs.get("watch") and self.rate:
            return PacedStream(self.watch, self.rate)
        return super().list_namespaced_lease(namespace, **kwargs)


def queued_workers(
    nodes: list[str], triggers: Triggers, watch: LeaseWatch, terms: Terms[Term]
) -> ReportWorkers:
    """A production worker over a reconciler that has seen every node's report fresh just now
    (renewals change nothing)."""
    api = client.ApiClient()
    counts = Counts()
    marker = pod_writer(
        api,
        counts,
        instance="bench",
        write_budget=WriteBudget(),
        due=triggers.due,
        refresh=lambda namespace, name, uid: None,
        memory=lambda: terms.current.marks,
        events=lambda: terms.current.events,
    )
    now = datetime.now(UTC)
    reconciler = Reconciler(api, marker, counts, triggers.queue, terms, renewals=watch.renewal)
    for node in nodes:
        reconciler.liveness.judge(node, 1, now, None, now)
    return ReportWorkers(
        reconciler,
        cast(Any, None),  # the pod and DRA indexes: read only by a reconcile, and none runs
        cast(Any, None),
        ActiveGate(None),
        cast(Any, None),  # the metrics: touched only by a reconcile or a failure
        read=lambda name: None,  # no reconcile runs
        debounce=Debounce(),
        clock=lambda: datetime.now(UTC),
        ready=lambda: True,
        workers=1,
    )


WAYS = ("watch_alone", "as_wired", "every_renewal_queued")
"""The Lease watch alone; wired as the operator wires it (Liveness.renewed); and each renewal
queued for a worker, the design Liveness.renewed avoids."""


def measure(data: bytes, nodes: list[str], rate: float, way: str) -> dict[str, Any]:
    news: list[set[str]] = []
    queue, terms = WorkQueue(), new_terms()
    triggers = Triggers(queue, lambda: terms.current.book)
    built: list[ReportWorkers] = []
    renewed: Callable[[str], None] = {
        "watch_alone": lambda node: None,
        "as_wired": lambda node: built[0].reconciler.liveness.renewed(node),  # noqa: PLW0108
        "every_renewal_queued": lambda node: queue.add(node, RENEWED),
    }[way]
    watch = LeaseWatch(
        PacedLeases(data, rate), "gpuusage-system", on_news=news.append, on_renewed=renewed
    )
    workers = queued_workers(nodes, triggers, watch, terms)
    built.append(workers)
    workers.start()
    watch.available.set()  # as start() leaves it once the probe answered
    informer = watch.informer
    version = informer.list_all()
    started, wall = time.process_time(), time.perf_counter()
    informer._watch(version)
    workers.queue.shut_down()  # the worker ends once the queue is drained
    for thread in workers._threads:
        thread.join()
    cpu = time.process_time() - started
    elapsed = time.perf_counter() - wall
    events = data.count(b"\n")
    renewals = sum(1 for node in nodes if (seen := watch._memory.get(node)) and seen.witnessed)
    return {
        "cpu_us_per_event": round(cpu / events * 1e6, 1),
        "wall_s": round(elapsed, 2),
        "nodes_seen_renewing": renewals,
        "at_5000_nodes_core_share": round(cpu / events * 500, 4),
        "reconciles": workers.reconciler.counts.reconciles,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rate", type=float, default=0.0, help="events a second; 0: unpaced")
    args = parser.parse_args()
    nodes = [f"gpu-{i:05d}" for i in range(args.nodes)]
    lines = []
    for n in range(args.events):
        renewed = T0 + timedelta(seconds=10 * (n // args.nodes), microseconds=n)
        event = {"type": "MODIFIED", "object": lease(nodes[n % args.nodes], 2 + n, renewed)}
        lines.append(json.dumps(event, separators=(",", ":")))
    data = ("\n".join(lines) + "\n").encode()
    results = {way: measure(data, nodes, args.rate, way) for way in WAYS}
    alone = results["watch_alone"]["cpu_us_per_event"]
    print(
        json.dumps(
            {
                "events": args.events,
                "event_bytes": len(data) // args.events,
                "rate": args.rate or "unpaced",
                **results,
                "ratios_to_watch_alone": {
                    way: round(results[way]["cpu_us_per_event"] / alone, 2) for way in WAYS[1:]
                },
            }
        )
    )


if __name__ == "__main__":
    main()
