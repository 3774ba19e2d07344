"""The kopf operator: a pod index, one reconcile per report event, and a staleness watch.

Choices, each for a reason:

* Reports are handled with `on.event`, not `on.create/update`: no diff-base annotation (which
  would copy the whole spec into metadata) and no finalizer on objects the agent owns.
* Staleness needs a clock, not an event (a dead agent sends none). Timers and daemons would put
  a finalizer on every report, so one background task checks a small index of observation
  times instead, and fetches and reconciles a report only when its freshness flips.
* kopf's own per-handler Events are off (they would land on every report every cycle); the
  operator records its own Events on pods, at the start and end of GPU use only.
* The pod index keeps a few fields per pod (see podindex), never whole bodies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.rest import load_rest_config
from gpuusage.operator.freshness import is_stale
from gpuusage.operator.podindex import PodLookup, PodRef, index_keys
from gpuusage.operator.reconcile import Reconciler

log = logging.getLogger(__name__)


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def build_registry(
    reconciler: Reconciler, kubeconfig: Path | None, resync_seconds: float, scratch: Path
) -> kopf.OperatorRegistry:
    """A registry with all handlers, bound to one reconciler (no module-level state)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.GROUP)
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

    @kopf.index("pods", id="pods", registry=registry)
    def pods(body: Mapping[str, Any], **_: Any) -> dict[str, PodRef]:
        return index_keys(body)

    @kopf.index(names.GROUP, names.VERSION, names.PLURAL, id="reports", registry=registry)
    def reports(body: Mapping[str, Any], **_: Any) -> dict[str, tuple[str | None, bool]]:
        """name → (observedAt, whether the last status said Stale): for the staleness watch."""
        conditions = (body.get("status") or {}).get("conditions") or []
        stale = any(c.get("type") == names.CONDITION_STALE and c.get("status") == "True"
                    for c in conditions)  # fmt: skip
        return {body["metadata"]["name"]: ((body.get("spec") or {}).get("observedAt"), stale)}

    # Indexes reach resource handlers only; the staleness task reads them from here.
    indexes: dict[str, Any] = {}

    @kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
    async def on_report(**kwargs: Any) -> None:
        indexes["pods"], indexes["reports"] = kwargs["pods"], kwargs["reports"]
        body: kopf.Body = kwargs["body"]
        lookup = PodLookup(kwargs["pods"])
        loop = asyncio.get_running_loop()
        now = datetime.now(UTC)
        if kwargs["type"] == "DELETED":
            node = (body.get("spec") or {}).get("nodeName") or body["metadata"]["name"]
            await loop.run_in_executor(None, reconciler.forget_node, node, lookup, now)
            return
        await loop.run_in_executor(None, reconciler.reconcile, dict(body), lookup, now)

    @kopf.on.startup(registry=registry)
    async def staleness(**kwargs: Any) -> None:
        memo: kopf.Memo = kwargs["memo"]
        memo["staleness"] = asyncio.create_task(
            _watch_staleness(reconciler, indexes, resync_seconds)
        )

    @kopf.on.cleanup(registry=registry)
    async def stop_staleness(**kwargs: Any) -> None:
        task = kwargs["memo"].get("staleness")
        if task is not None:
            task.cancel()

    return registry


async def _watch_staleness(
    reconciler: Reconciler, indexes: dict[str, Any], interval: float
) -> None:
    """Reconcile a report when its freshness flips; the report itself sends no event then."""
    loop = asyncio.get_running_loop()
    custom = client.CustomObjectsApi(reconciler.api)

    def fetch_and_reconcile(name: str, now: datetime) -> None:
        body = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, name)
        assert isinstance(body, dict)
        reconciler.reconcile(body, PodLookup(indexes["pods"]), now)

    while True:
        await asyncio.sleep(interval)
        if "reports" not in indexes:
            continue
        now = datetime.now(UTC)
        for name, values in list(indexes["reports"].items()):
            for observed, was_stale in list(values):
                when = _parse_time(observed)
                if when is None or is_stale(when, now, reconciler.stale_after) == was_stale:
                    continue
                try:
                    await loop.run_in_executor(None, fetch_and_reconcile, name, now)
                except Exception as exc:  # keep watching the other reports
                    log.warning("staleness check of %s: %s", name, exc)
