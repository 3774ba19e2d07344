"""The operator's housekeeping pass: the work no report event triggers.

Staleness needs a clock, not an event (a dead agent sends none). Timers and daemons would put a
finalizer on every report, so one background task checks the reconciler's small table of
sightings instead, and fetches and reconciles a report only when its freshness flips, when a
pod of it has been idle for --idle-after (a report that does not change sends no event), when
a pod it lists was deleted, or when pods carry our marks for a node without a report. It also
probes the API, so that an outage is logged once and its end once.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import Clock, utc_now
from gpuusage.kube.errors import NotFound, translate
from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.dra import NO_DRA
from gpuusage_operator.drawatch import DraWatch
from gpuusage_operator.ha import ActiveGate
from gpuusage_operator.leasewatch import LeaseWatch
from gpuusage_operator.podwatch import PodWatch
from gpuusage_operator.reconcile import Reconciler

log = logging.getLogger(__name__)
PROBE_TIMEOUT = 5.0


def revisit(
    reconciler: Reconciler, pods: PodWatch, dra: DraWatch | None, name: str, now: datetime
) -> None:
    """Read a report and reconcile it (a report found gone loses its pods' marks)."""
    custom = client.CustomObjectsApi(reconciler.api)
    try:
        body = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, name)
    except Exception as exc:
        if isinstance(translate(exc), NotFound):
            reconciler.forget_node(name, pods.lookup(), now)
            return
        raise
    assert isinstance(body, dict)
    reconciler.reconcile(body, pods.lookup(), now, NO_DRA if dra is None else dra.lookup())


async def housekeeping(
    reconciler: Reconciler,
    pods: PodWatch,
    interval: float,
    gate: ActiveGate,
    *,
    health: ApiHealth,
    known: set[str],
    clock: Clock = utc_now,
    dra: DraWatch | None = None,
    leases: LeaseWatch | None = None,
) -> None:
    """Every `interval`: check that the API answers, then revisit the reports that send no
    event of their own but need a reconcile: those whose freshness flipped (a dead agent writes
    nothing), those with a pod idle for --idle-after by now, those listing a pod that was
    deleted, and nodes whose pods carry our marks while kopf has delivered no report for them
    (a report deleted while no replica watched; `known` holds the names of the reports kopf's
    watch has shown, and a GET confirms the absence)."""
    loop = asyncio.get_running_loop()
    custom = client.CustomObjectsApi(reconciler.api)

    def probe() -> bool:
        """A read that needs etcd (a consistent list), so that its outage is noticed too."""
        try:
            custom.list_cluster_custom_object(
                names.GROUP, names.VERSION, names.PLURAL, limit=1, _request_timeout=PROBE_TIMEOUT
            )
        except Exception as exc:
            health.failed("probe", translate(exc))
            return False
        health.succeeded()
        return True

    def again(name: str, now: datetime) -> None:
        revisit(reconciler, pods, dra, name, now)

    while True:
        await asyncio.sleep(interval)
        if not await loop.run_in_executor(None, probe):
            continue
        ready = (
            pods.synced.is_set()
            and (dra is None or dra.synced)
            and (leases is None or leases.synced)
        )
        if not ready or not await gate.active():
            continue
        now = clock()
        due = set(reconciler.staleness_flipped(now)) | reconciler.take_due()
        due |= set(reconciler.idle_deadlines_passed(now))
        due |= {n for n in pods.lookup().nodes_with_our_marks() if n not in known}
        for name in sorted(due):
            try:
                await loop.run_in_executor(None, again, name, now)
            except Exception as exc:  # keep going with the other reports
                log.warning("revisiting report %s: %s", name, exc)
