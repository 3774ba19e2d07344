"""The kopf wiring: the informers, the workers and the housekeeping pass, run in kopf's runtime.

* kopf is the operator's runtime: its event loop, startup and cleanup, login, the liveness
  endpoint; it watches nothing (kopfsetup). It runs without peering on every replica; which
  one acts is decided by the operator's Lease (see ha.leader), and every replica's informers
  keep their caches warm. The reports, pods, Leases, claims and policies are watched by our
  own informers (see informers: why not kopf's watch), which only queue names (see
  workqueue): one worker per report at a time, deadlines, retries with a backoff; the worker
  reads the report from the report watch's cache (see controller.workers). No diff-base
  annotation and no finalizer on the objects the agent owns.
* The pod index keeps a few fields per pod (see index.pods), never whole bodies. Reports are
  reconciled only once the reports', pods', claims' and Leases' informers hold their complete
  first listings; the policies' informer gates the policy steps alone (a policy step on a
  partial view of the policies neither acts nor cancels: policies.run).
* Every write path first asks the ActiveGate (see ha), and every write request asks it again
  just before it is sent (ha.fence); the housekeeping pass (see
  housekeeping) probes the API, finds marks of nodes without a report and publishes the
  OpenReports; kopf's settings and login are in kopfsetup.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import kopf

from gpuusage.api.times import Clock, utc_now
from gpuusage.kube.config import REQUEST_TIMEOUT
from gpuusage_operator.controller.debounce import DEFAULT_INTERVAL, Debounce
from gpuusage_operator.controller.housekeeping import housekeeping
from gpuusage_operator.controller.reconcile import Reconciler
from gpuusage_operator.controller.triggers import EVENT
from gpuusage_operator.controller.workers import ReportWorkers
from gpuusage_operator.ha.election import Election
from gpuusage_operator.ha.fence import fence_writes
from gpuusage_operator.ha.leader import ActiveGate, LeaseElector
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.drawatch import DraWatch
from gpuusage_operator.informers.informer import Informer
from gpuusage_operator.informers.leasewatch import LeaseWatch
from gpuusage_operator.informers.namespacewatch import NamespaceState
from gpuusage_operator.informers.podwatch import PodWatch
from gpuusage_operator.informers.policywatch import PolicyWatch
from gpuusage_operator.informers.reportwatch import ReportWatch
from gpuusage_operator.kopfsetup import configure_kopf, connection_info
from gpuusage_operator.metrics import OperatorMetrics
from gpuusage_operator.openreports.gather import gather
from gpuusage_operator.openreports.writer import OpenReportsWriter

log = logging.getLogger(__name__)


def build_registry(
    reconciler: Reconciler,
    reports: ReportWatch,
    pods: PodWatch,
    metrics: OperatorMetrics,
    *,
    kubeconfig: Path | None,
    resync_seconds: float,
    elector: LeaseElector | None,
    reconcile_workers: int,
    health: ApiHealth,
    dra: DraWatch,
    leases: LeaseWatch,
    clock: Clock = utc_now,
    policies: PolicyWatch | None = None,
    namespaces: Informer[NamespaceState] | None = None,
    api_timeout: float = REQUEST_TIMEOUT,
    report_interval: float = DEFAULT_INTERVAL,
    openreports: OpenReportsWriter | None = None,
) -> kopf.OperatorRegistry:
    """A registry with all handlers, bound to one reconciler (no module-level state)."""
    registry = kopf.OperatorRegistry()

    def began() -> None:
        """A new term (its memories are new, see ha.terms): another replica may have written
        meanwhile, so every report is judged again (a standby's workers drop what they take),
        and every node whose pods carry our marks: its report may have gone meanwhile (the
        worker finds it absent and clears them, as the housekeeping pass would later). The
        policies are listed again before any acts: the last leader's counts of its actions
        (their status) may not have come through the watch yet, and the cluster-wide limit
        adds up every policy's."""
        metrics.leadership_acquired.inc()
        for name in reports.names() | pods.lookup().nodes_with_our_marks():
            reconciler.queue.add(name, EVENT)
        if policies is not None and policies.available.is_set():  # else nothing is watched
            policies.policies.relist()

    election: Election | None = elector.election if elector is not None else None
    gate = ActiveGate(election)
    fence_writes(reconciler.api, gate.active_now)

    def ready() -> bool:
        return reports.synced.is_set() and pods.synced.is_set() and dra.synced and leases.synced

    workers = ReportWorkers(
        reconciler,
        pods,
        dra,
        gate,
        metrics,
        read=reports.get,
        debounce=Debounce(report_interval),
        clock=clock,
        ready=ready,
        workers=reconcile_workers,
    )

    def publish() -> None:
        """The OpenReports brought in line with the findings, once the policies are read (a
        node rule's policy is named in its results)."""
        assert openreports is not None
        watch = reconciler.policies.watch if reconciler.policies is not None else None
        if watch is not None and not watch.synced:
            return
        found = watch.node_rule() if watch is not None else None
        rule = None if found is None else (found[0].name, found[1])
        findings = gather(pods.lookup(), reconciler.book, reports.names(), rule)
        openreports.publish(findings.namespaces, findings.nodes, findings.keep, now=clock())

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, api_timeout)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        """kopf asks again after a 401, so an expiring token (exec plugin, bound token) is
        fetched afresh."""
        return connection_info(kubeconfig)

    metrics.active.set_function(lambda: float(gate.last))
    metrics.reports.set_function(lambda: len(reports))

    @kopf.on.startup(registry=registry)
    async def start_tasks(**kwargs: Any) -> None:
        memo: kopf.Memo = kwargs["memo"]
        memo["reports"] = threading.Thread(target=reports.run, name="report-watch", daemon=True)
        memo["reports"].start()
        memo["pod_watch"] = threading.Thread(target=pods.run, name="pod-watch", daemon=True)
        memo["pod_watch"].start()
        memo["dra"] = threading.Thread(target=dra.start, name="dra-start", daemon=True)
        memo["dra"].start()
        memo["leases"] = threading.Thread(target=leases.start, name="lease-start", daemon=True)
        memo["leases"].start()
        if namespaces is not None:
            memo["namespaces"] = threading.Thread(
                target=namespaces.run, name="namespace-watch", daemon=True
            )
            memo["namespaces"].start()
        if policies is not None:
            memo["policies"] = threading.Thread(
                target=policies.start, name="policy-start", daemon=True
            )
            memo["policies"].start()
        workers.start()
        if elector is not None:
            elector.start(on_change=gate.active_now, on_term=began)
        memo["housekeeping"] = asyncio.create_task(
            housekeeping(
                reconciler,
                pods,
                resync_seconds,
                gate,
                health=health,
                known=reports.names,
                ready=ready,
                publish=publish if openreports is not None else None,
            )
        )

    @kopf.on.cleanup(registry=registry)
    async def stop_tasks(**kwargs: Any) -> None:
        reports.stop()
        pods.stop()
        dra.stop()
        leases.stop()
        if policies is not None:
            policies.stop()
        if namespaces is not None:
            namespaces.stop()
        task = kwargs["memo"].get("housekeeping")
        if task is not None:
            task.cancel()
        await asyncio.to_thread(workers.stop)  # waits for the reconciles in progress
        if elector is not None:  # only now: nothing of this replica is writing any more
            await asyncio.to_thread(elector.stop)

    return registry
