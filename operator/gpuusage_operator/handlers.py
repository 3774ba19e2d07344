"""The kopf wiring: one reconcile per report event, and the tasks beside it.

* Reports are handled with `on.event`, not `on.create/update`: no diff-base annotation (which
  would copy the whole spec into metadata) and no finalizer on objects the agent owns.
* The pod index keeps a few fields per pod (see podindex), never whole bodies, and is kept by
  our own list-and-watch (see podwatch for why not a kopf index). Reports are handled only
  once it holds the complete first listing.
* Every write path first asks the ActiveGate (see ha); the housekeeping pass (see
  housekeeping) does what no event triggers; kopf's settings and login are in kopfsetup.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kopf

from gpuusage.api import names
from gpuusage.api.times import Clock, utc_now
from gpuusage.kube.config import REQUEST_TIMEOUT
from gpuusage.retry import doubling
from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.debounce import DEFAULT_INTERVAL, Debounce
from gpuusage_operator.drawatch import DraWatch
from gpuusage_operator.ha import ActiveGate
from gpuusage_operator.housekeeping import housekeeping, revisit
from gpuusage_operator.informer import WATCH_IDLE
from gpuusage_operator.kopfsetup import configure_kopf, connection_info
from gpuusage_operator.leasewatch import LeaseWatch
from gpuusage_operator.metrics import OperatorMetrics
from gpuusage_operator.peering import Peering
from gpuusage_operator.podwatch import PodWatch
from gpuusage_operator.policywatch import PolicyWatch
from gpuusage_operator.reconcile import Reconciler

log = logging.getLogger(__name__)
RETRY_CAP = 60.0
RETRY = doubling(1.0, RETRY_CAP)
"""A failed reconcile is tried again after 1, 2, 4 ... then every 60 seconds."""


def build_registry(
    reconciler: Reconciler,
    pods: PodWatch,
    metrics: OperatorMetrics,
    *,
    kubeconfig: Path | None,
    resync_seconds: float,
    peering: Peering | None,
    reconcile_workers: int,
    health: ApiHealth,
    dra: DraWatch,
    leases: LeaseWatch,
    clock: Clock = utc_now,
    policies: PolicyWatch | None = None,
    timeouts: tuple[float, float] = (REQUEST_TIMEOUT, WATCH_IDLE),
    report_interval: float = DEFAULT_INTERVAL,
) -> kopf.OperatorRegistry:
    """A registry with all handlers, bound to one reconciler (no module-level state)."""
    registry = kopf.OperatorRegistry()
    gate = ActiveGate(reconciler.api, peering, clock, reconciler.marker.forget_written)
    # Reconciles spend most of their time waiting for the apiserver: with asyncio's default
    # pool (CPU count + 4 threads) a slower apiserver turned into a growing backlog.
    workers = ThreadPoolExecutor(max_workers=reconcile_workers, thread_name_prefix="reconcile")

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, peering, *timeouts)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        """kopf asks again after a 401, so an expiring token (exec plugin, bound token) is
        fetched afresh."""
        return connection_info(kubeconfig)

    known: set[str] = set()  # report names kopf's watch has shown: the metric, housekeeping
    debounce = Debounce(report_interval)
    failures: dict[str, int] = {}
    """Report name → reconciles that failed in a row: each is tried again after a backoff,
    its latest version, until one succeeds (the next event may be minutes away)."""

    def failed(name: str, exc: Exception) -> None:
        attempt = failures.get(name, 0)
        failures[name] = attempt + 1
        delay = RETRY.delay(attempt) or RETRY_CAP
        metrics.reconcile_failures.labels(kind=type(exc).__name__).inc()
        log.warning("reconciling report %s failed (%s); again in %.0f s", name, exc, delay)
        asyncio.get_running_loop().call_later(delay, lambda: asyncio.ensure_future(held(name)))

    async def held(name: str) -> None:
        """A reconcile held back (a report rewritten too often) or tried again after a
        failure: the report's latest version, now."""
        loop = asyncio.get_running_loop()
        debounce.ran(name, loop.time())
        if name not in known or not await gate.active():
            failures.pop(name, None)  # gone, or another replica's now
            return
        started = time.monotonic()
        try:
            await loop.run_in_executor(workers, revisit, reconciler, pods, dra, name, clock())
        except Exception as exc:
            failed(name, exc)
        else:
            failures.pop(name, None)
        finally:
            metrics.reconcile_seconds.observe(time.monotonic() - started)

    metrics.active.set_function(lambda: float(gate.last))
    metrics.reports.set_function(lambda: len(known))

    @kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
    async def on_report(**kwargs: Any) -> None:
        body: kopf.Body = kwargs["body"]
        name = body["metadata"]["name"]
        if kwargs["type"] == "DELETED":
            known.discard(name)
        else:
            known.add(name)
        if not await gate.active():
            return  # kopf re-lists everything when this replica's watches resume
        while not (pods.synced.is_set() and dra.synced and leases.synced):  # no thread parked
            await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        lookup = pods.lookup()
        now = clock()
        if kwargs["type"] == "DELETED":
            debounce.forget(name)
            node = (body.get("spec") or {}).get("nodeName") or name
            await loop.run_in_executor(workers, reconciler.forget_node, node, lookup, now)
            return
        if reconciler.is_echo(body):
            metrics.echoes_skipped.inc()
            return
        wait = debounce.wait(name, loop.time())
        if wait > 0:  # rewritten within the interval: its latest version, once it has passed
            metrics.reports_held.inc()
            if debounce.hold(name):
                loop.call_later(wait, lambda: asyncio.ensure_future(held(name)))
            return
        debounce.ran(name, loop.time())
        started = time.monotonic()
        try:
            await loop.run_in_executor(
                workers, reconciler.reconcile, dict(body), lookup, now, dra.lookup()
            )
        except Exception as exc:
            failed(name, exc)  # tried again after a backoff, until it succeeds
        else:
            failures.pop(name, None)
        finally:
            metrics.reconcile_seconds.observe(time.monotonic() - started)

    @kopf.on.startup(registry=registry)
    async def start_tasks(**kwargs: Any) -> None:
        memo: kopf.Memo = kwargs["memo"]
        memo["pod_watch"] = threading.Thread(target=pods.run, name="pod-watch", daemon=True)
        memo["pod_watch"].start()
        memo["dra"] = threading.Thread(target=dra.start, name="dra-start", daemon=True)
        memo["dra"].start()
        memo["leases"] = threading.Thread(target=leases.start, name="lease-start", daemon=True)
        memo["leases"].start()
        if policies is not None:
            memo["policies"] = threading.Thread(
                target=policies.start, name="policy-start", daemon=True
            )
            memo["policies"].start()
        memo["housekeeping"] = asyncio.create_task(
            housekeeping(
                reconciler,
                pods,
                resync_seconds,
                gate,
                health=health,
                known=known,
                clock=clock,
                dra=dra,
                leases=leases,
            )
        )

    @kopf.on.cleanup(registry=registry)
    async def stop_tasks(**kwargs: Any) -> None:
        pods.stop()
        dra.stop()
        leases.stop()
        if policies is not None:
            policies.stop()
        workers.shutdown(wait=False, cancel_futures=True)
        task = kwargs["memo"].get("housekeeping")
        if task is not None:
            task.cancel()

    return registry
