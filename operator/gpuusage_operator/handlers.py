"""The kopf operator: a pod index, one reconcile per report event, and housekeeping.

Choices, each for a reason:

* Reports are handled with `on.event`, not `on.create/update`: no diff-base annotation (which
  would copy the whole spec into metadata) and no finalizer on objects the agent owns.
* Staleness needs a clock, not an event (a dead agent sends none). Timers and daemons would put
  a finalizer on every report, so one background task (housekeeping) checks the reconciler's
  small table of sightings instead, and fetches and reconciles a report only when its freshness
  flips, when a pod it lists was deleted, or when pods carry our marks for a node without a
  report. It also probes the API, so that an outage is logged once and its end once.
* kopf's own per-handler Events are off (they would land on every report every cycle); the
  operator records its own Events on pods, at the start and end of GPU use only.
* The pod index keeps a few fields per pod (see podindex), never whole bodies, and is kept by
  our own list-and-watch (see podwatch for why not a kopf index). Reports are handled only
  once it holds the complete first listing.
* HA: kopf pauses a standby replica's watches, but only once it has seen a peer with a
  higher priority, and not our own staleness task. Replicas that start together would both
  act for a moment, so every write path first asks an ActiveGate, which applies kopf's rule to
  a fresh read of the peering object after a short settling time (see peering).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage.kube.errors import NotFound, translate
from gpuusage_operator import peering as peers
from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.metrics import OperatorMetrics
from gpuusage_operator.peering import Peering
from gpuusage_operator.podwatch import PodWatch
from gpuusage_operator.reconcile import Reconciler

log = logging.getLogger(__name__)
PROBE_TIMEOUT = 5.0


class ActiveGate:
    """Whether this replica may write now, by kopf's peering rule on a fresh read.

    A "yes" is remembered for a second (a handover may then see one duplicate write, which is
    idempotent); a "no" never is, so a replica that has just become active is never held back
    by what it read before.
    """

    REMEMBER_YES = 1.0

    def __init__(self, api: client.ApiClient, peering: Peering | None) -> None:
        self._custom = client.CustomObjectsApi(api)
        self._peering = peering
        self._settled_at = time.monotonic() + (peering.settle if peering else 0.0)
        self._yes_until = 0.0
        self._last: bool | None = None

    def _read(self) -> bool:
        assert self._peering is not None
        body = self._custom.get_cluster_custom_object(
            names.PEERING_GROUP, names.PEERING_VERSION, names.PEERING_PLURAL, self._peering.name
        )
        status = (body.get("status") or {}) if isinstance(body, dict) else {}
        return peers.is_active(
            status, self._peering.identity, self._peering.priority, datetime.now(UTC)
        )

    async def active(self) -> bool:
        if self._peering is None:
            self._last = True
            return True
        wait = self._settled_at - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if time.monotonic() < self._yes_until:
            return True
        try:
            answer = await asyncio.get_running_loop().run_in_executor(None, self._read)
        except Exception as exc:  # cannot tell: a standby must not write
            log.warning("cannot read peering %s: %s", self._peering.name, exc)
            answer = False
        if answer:
            self._yes_until = time.monotonic() + self.REMEMBER_YES
        if answer != self._last:
            log.info("this replica is %s", "active" if answer else "on standby")
            self._last = answer
        return answer

    @property
    def last(self) -> bool:
        """The latest answer (False before the first); for the `active` metric."""
        return bool(self._last)


class RetryForever:
    """Backoffs for kopf's API requests that never run out: 1, 1, 2, 3, 5, then every 10 s.

    Iterated afresh for every request, and not Sized, so that kopf counts no last attempt.
    """

    def __init__(self, steps: tuple[float, ...] = (1, 1, 2, 3, 5), then: float = 10) -> None:
        self.steps, self.then = steps, then

    def __iter__(self) -> Iterator[float]:
        return itertools.chain(self.steps, itertools.repeat(self.then))


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: this operator has event handlers only, which need none.

    kopf builds the diff base (a deep copy of the whole object, status included) for every
    event before it looks at the handlers; with our own status writes echoing back, that was
    about a sixth of the operator's CPU per report update. Nothing is stored on the objects
    either.
    """

    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[Any] | None = None,
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing to keep."""


def configure_kopf(settings: kopf.OperatorSettings, peering: Peering | None) -> None:
    """kopf's settings for this operator (the startup handler applies them)."""
    settings.posting.enabled = False
    if peering is not None:
        settings.peering.lifetime = peering.lifetime
        settings.peering.stealth = True  # keep-alives are not worth a log line each
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 300
    # kopf gives up a request after its backoffs (54 s in all) and then stops watching reports
    # for good: several apiserver restarts in a row left the operator deaf until it was
    # restarted (benchmarks/README.md, fault soak). Retry for as long as it takes.
    settings.networking.error_backoffs = RetryForever()


def connection_info(kubeconfig: Path | None) -> kopf.ConnectionInfo:
    """kopf's credentials from the loader every other client of the operator uses (the
    `kubernetes` package's, found as kube.config finds it): kubeconfig users with client
    certificates, tokens, token files or exec credential plugins (what EKS, GKE and AKS
    write), or the in-cluster service account."""
    api, _source = api_client(kubeconfig)
    try:
        config = api.configuration
        header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix(
            "authorization"
        )
    finally:
        api.close()  # type: ignore[no-untyped-call]
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
    )


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
) -> kopf.OperatorRegistry:
    """A registry with all handlers, bound to one reconciler (no module-level state)."""
    registry = kopf.OperatorRegistry()
    gate = ActiveGate(reconciler.api, peering)
    # Reconciles spend most of their time waiting for the apiserver: with asyncio's default
    # pool (CPU count + 4 threads) a slower apiserver turned into a growing backlog.
    workers = ThreadPoolExecutor(max_workers=reconcile_workers, thread_name_prefix="reconcile")

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, peering)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        """kopf asks again after a 401, so an expiring token (exec plugin, bound token) is
        fetched afresh."""
        return connection_info(kubeconfig)

    known: set[str] = set()  # report names kopf's watch has shown: the metric, housekeeping
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
        while not pods.synced.is_set():  # no thread parked per waiting report
            await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        lookup = pods.lookup()
        now = datetime.now(UTC)
        if kwargs["type"] == "DELETED":
            node = (body.get("spec") or {}).get("nodeName") or name
            await loop.run_in_executor(workers, reconciler.forget_node, node, lookup)
            return
        if reconciler.is_echo(body):
            metrics.echoes_skipped.inc()
            return
        started = time.monotonic()
        try:
            await loop.run_in_executor(workers, reconciler.reconcile, dict(body), lookup, now)
        except Exception as exc:
            metrics.reconcile_failures.labels(kind=type(exc).__name__).inc()
            raise  # kopf logs it; the next report event (heartbeat) tries again
        finally:
            metrics.reconcile_seconds.observe(time.monotonic() - started)

    @kopf.on.startup(registry=registry)
    async def start_tasks(**kwargs: Any) -> None:
        memo: kopf.Memo = kwargs["memo"]
        memo["pod_watch"] = threading.Thread(target=pods.run, name="pod-watch", daemon=True)
        memo["pod_watch"].start()
        memo["housekeeping"] = asyncio.create_task(
            _housekeeping(reconciler, pods, resync_seconds, gate, health=health, known=known)
        )

    @kopf.on.cleanup(registry=registry)
    async def stop_tasks(**kwargs: Any) -> None:
        pods.stop()
        workers.shutdown(wait=False, cancel_futures=True)
        task = kwargs["memo"].get("housekeeping")
        if task is not None:
            task.cancel()

    return registry


async def _housekeeping(
    reconciler: Reconciler,
    pods: PodWatch,
    interval: float,
    gate: ActiveGate,
    *,
    health: ApiHealth,
    known: set[str],
) -> None:
    """Every `interval`: check that the API answers, then revisit the reports that send no
    event of their own but need a reconcile: those whose freshness flipped (a dead agent writes
    nothing), those listing a pod that was deleted, and nodes whose pods carry our marks while
    kopf has delivered no report for them (a report deleted while no replica watched; `known`
    holds the names of the reports kopf's watch has shown, and a GET confirms the absence)."""
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

    def revisit(name: str, now: datetime) -> None:
        try:
            body = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, name)
        except Exception as exc:
            if isinstance(translate(exc), NotFound):
                reconciler.forget_node(name, pods.lookup())
                return
            raise
        assert isinstance(body, dict)
        reconciler.reconcile(body, pods.lookup(), now)

    while True:
        await asyncio.sleep(interval)
        if not await loop.run_in_executor(None, probe):
            continue
        if not pods.synced.is_set() or not await gate.active():
            continue
        now = datetime.now(UTC)
        due = set(reconciler.staleness_flipped(now)) | reconciler.take_due()
        due |= {n for n in pods.lookup().nodes_with_our_marks() if n not in known}
        for name in sorted(due):
            try:
                await loop.run_in_executor(None, revisit, name, now)
            except Exception as exc:  # keep going with the other reports
                log.warning("revisiting report %s: %s", name, exc)
