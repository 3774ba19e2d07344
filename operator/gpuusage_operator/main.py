"""`gpuusage operator`: run the kopf operator until stopped."""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from typing import Any, cast

import kopf
from kubernetes import client

from gpuusage.kube.config import api_client
from gpuusage.kube.crds import ensure_peering
from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.handlers import build_registry
from gpuusage_operator.metrics import OperatorMetrics
from gpuusage_operator.peering import Peering, own_identity, random_priority
from gpuusage_operator.podwatch import PodWatch
from gpuusage_operator.reconcile import Reconciler
from gpuusage_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def run_operator(
    settings: OperatorSettings,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    reconciler_out: list[Reconciler] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or stop_flag). reconciler_out receives the reconciler, so
    tests and benchmarks can read its write counts."""
    log.info("operator settings: %s", json.dumps(settings.redacted(), sort_keys=True))
    # Every call retries with its own bounded backoff (kube.errors.call, the pod watch's
    # relist, the next report): urllib3's own retries would only multiply the waits.
    api, source = api_client(settings.kubeconfig, pool_size=settings.workers + 4, retries=0)
    log.info("API from %s (%s)", source.origin, source.detail)
    identity = own_identity()
    watch_api, _ = api_client(settings.kubeconfig, retries=0)  # the pod watch's own connection
    health = ApiHealth()
    reconciler = Reconciler(
        api,
        stale_after=timedelta(seconds=settings.stale_after),
        idle_after=timedelta(seconds=settings.idle_after) if settings.idle_after else None,
        instance=identity,
    )
    pods = PodWatch(client.CoreV1Api(watch_api), health=health, on_deleted=reconciler.pods_deleted)
    reconciler.refresh = pods.refresh  # the two know each other: each tells the other of a pod
    if reconciler_out is not None:
        reconciler_out.append(reconciler)
    peering = None
    if not settings.standalone:
        priority = random_priority() if settings.priority is None else settings.priority
        peering = Peering(settings.peering, identity, priority, settings.peering_lifetime)
        log.info("peering %r as %s with priority %d", peering.name, identity, priority)
        try:
            ensure_peering(api, peering.name)
        except Exception as exc:  # kopf then says clearly that the peering is missing
            log.warning("cannot create ClusterKopfPeering %s: %s", peering.name, exc)
    try:
        metrics = OperatorMetrics(reconciler, lambda: len(pods), health)
        if settings.metrics_port:
            metrics.serve(settings.metrics_address, settings.metrics_port)
        registry = build_registry(
            reconciler,
            pods,
            metrics,
            kubeconfig=settings.kubeconfig,
            resync_seconds=settings.resync,
            peering=peering,
            reconcile_workers=settings.workers,
            health=health,
        )
        kopf.run(
            registry=registry,
            clusterwide=True,
            standalone=settings.standalone,
            peering_name=None if peering is None else peering.name,
            priority=None if peering is None else peering.priority,
            identity=cast(Any, identity),  # kopf's Identity is a NewType of str
            liveness_endpoint=(
                f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
            ),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        pods.stop()
        watch_api.close()  # type: ignore[no-untyped-call]
        api.close()  # type: ignore[no-untyped-call]
    return 0
