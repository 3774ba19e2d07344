"""The kopf operator: a pod index, one reconcile per report event, and a staleness watch.

Choices, each for a reason:

* Reports are handled with `on.event`, not `on.create/update`: no diff-base annotation (which
  would copy the whole spec into metadata) and no finalizer on objects the agent owns.
* Staleness needs a clock, not an event (a dead agent sends none). Timers and daemons would put
  a finalizer on every report, so one background task checks a small table of observation
  times instead, and fetches and reconciles a report only when its freshness flips.
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
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import parse_time
from gpuusage.kube.rest import load_rest_config
from gpuusage.operator import peering as peers
from gpuusage.operator.freshness import is_stale
from gpuusage.operator.metrics import OperatorMetrics
from gpuusage.operator.peering import Peering
from gpuusage.operator.podwatch import PodWatch
from gpuusage.operator.reconcile import Reconciler

log = logging.getLogger(__name__)


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


def report_freshness(body: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(observedAt, whether the report's last status said Stale)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    stale = any(c.get("type") == names.CONDITION_STALE and c.get("status") == "True"
                for c in conditions)  # fmt: skip
    return (body.get("spec") or {}).get("observedAt"), stale


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


def build_registry(
    reconciler: Reconciler,
    pods: PodWatch,
    metrics: OperatorMetrics,
    *,
    kubeconfig: Path | None,
    resync_seconds: float,
    scratch: Path,
    peering: Peering | None,
    reconcile_workers: int,
) -> kopf.OperatorRegistry:
    """A registry with all handlers, bound to one reconciler (no module-level state)."""
    registry = kopf.OperatorRegistry()
    gate = ActiveGate(reconciler.api, peering)
    # Reconciles spend most of their time waiting for the apiserver: with asyncio's default
    # pool (CPU count + 4 threads) a slower apiserver turned into a growing backlog.
    workers = ThreadPoolExecutor(max_workers=reconcile_workers, thread_name_prefix="reconcile")

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False
        if peering is not None:
            settings.peering.lifetime = peering.lifetime
            settings.peering.stealth = True  # keep-alives are not worth a log line each
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = NoDiffBase()
        settings.watching.server_timeout = 300

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        """Same resolution as the agent's (flag, $KUBECONFIG, in-cluster, ~/.kube/config)."""
        rest, _source = load_rest_config(kubeconfig, scratch)
        token = rest.token
        if rest.token_file is not None:
            token = rest.token_file.read_text().strip()
        return kopf.ConnectionInfo(
            server=rest.server,
            ca_path=str(rest.ca_file) if rest.ca_file else None,
            insecure=rest.insecure or None,
            certificate_path=str(rest.cert_file) if rest.cert_file else None,
            private_key_path=str(rest.key_file) if rest.key_file else None,
            token=token,
            scheme="Bearer" if token else None,
        )

    # name → (observedAt, whether the last status said Stale), for the staleness watch.
    freshness: dict[str, tuple[str | None, bool]] = {}
    metrics.active.set_function(lambda: float(gate.last))
    metrics.reports.set_function(lambda: len(freshness))

    @kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
    async def on_report(**kwargs: Any) -> None:
        body: kopf.Body = kwargs["body"]
        name = body["metadata"]["name"]
        if kwargs["type"] == "DELETED":
            freshness.pop(name, None)
        else:
            freshness[name] = report_freshness(body)
        if not await gate.active():
            return  # kopf re-lists everything when this replica's watches resume
        while not pods.synced.is_set():  # no thread parked per waiting report
            await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        lookup = pods.lookup()
        now = datetime.now(UTC)
        if kwargs["type"] == "DELETED":
            node = (body.get("spec") or {}).get("nodeName") or name
            await loop.run_in_executor(workers, reconciler.forget_node, node, lookup, now)
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
        memo["staleness"] = asyncio.create_task(
            _watch_staleness(reconciler, pods, freshness, resync_seconds, gate)
        )

    @kopf.on.cleanup(registry=registry)
    async def stop_tasks(**kwargs: Any) -> None:
        pods.stop()
        workers.shutdown(wait=False, cancel_futures=True)
        task = kwargs["memo"].get("staleness")
        if task is not None:
            task.cancel()

    return registry


async def _watch_staleness(
    reconciler: Reconciler,
    pods: PodWatch,
    freshness: dict[str, tuple[str | None, bool]],
    interval: float,
    gate: ActiveGate,
) -> None:
    """Reconcile a report when its freshness flips; the report itself sends no event then."""
    loop = asyncio.get_running_loop()
    custom = client.CustomObjectsApi(reconciler.api)

    def fetch_and_reconcile(name: str, now: datetime) -> None:
        body = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, name)
        assert isinstance(body, dict)
        reconciler.reconcile(body, pods.lookup(), now)

    while True:
        await asyncio.sleep(interval)
        if not pods.synced.is_set() or not await gate.active():
            continue
        now = datetime.now(UTC)
        for name, (observed, was_stale) in list(freshness.items()):
            when = parse_time(observed)
            if when is None or is_stale(when, now, reconciler.stale_after) == was_stale:
                continue
            try:
                await loop.run_in_executor(None, fetch_and_reconcile, name, now)
            except Exception as exc:  # keep watching the other reports
                log.warning("staleness check of %s: %s", name, exc)
