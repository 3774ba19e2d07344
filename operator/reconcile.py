"""Apply what the pure core wants: GpuNodeUsage status, pod annotations, pod condition, Events.

One idempotent reconcile per report, run in kopf's executor (the `kubernetes` client is
synchronous). Writes happen only where the desired state differs from what is known: the pod
index (our annotations and condition are part of each entry) or, after our own writes, a
last-applied cache that covers the moment before the watch delivers them. The cache is trusted
only while the index shows a resourceVersion this replica produced or saw before writing: once
anyone else changes the pod (another replica after a failover, a person removing an
annotation) the index wins. An unchanged report therefore costs no write at all, and nothing a
replica remembers can mask what is really on the pod. One pod failing (deleted meanwhile: 404)
never stops the rest.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter as TallyCounter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client
from pydantic import ValidationError

from gpuusage.api import names
from gpuusage.api.models import GpuNodeUsageSpec, GpuNodeUsageStatus
from gpuusage.kube import raw
from gpuusage.kube.errors import NotFound, call
from gpuusage.operator.freshness import DEFAULT_STALE_AFTER, is_stale
from gpuusage.operator.idle import DEFAULT_IDLE_AFTER, Idle, idle_pods, report_is_complete
from gpuusage.operator.podindex import PodLookup, PodRef
from gpuusage.operator.podstate import (
    PodEvent,
    PodUse,
    UseState,
    annotation_patch,
    condition_patch,
    desired_annotations,
    desired_condition,
    event_for,
    pod_uses,
)
from gpuusage.operator.resolution import resolve_all
from gpuusage.operator.status import desired_status

log = logging.getLogger(__name__)
STRATEGIC = "application/strategic-merge-patch+json"
COMPONENT = "gpuusage.io/operator"


@dataclass
class Counts:
    """Writes made; the benchmark and the zero-write tests read these."""

    status_writes: int = 0
    pod_writes: int = 0
    events: int = 0
    api_errors: TallyCounter[str] = field(default_factory=TallyCounter)
    """Pod write failures by kind (NotFound is no failure: the pod went away meanwhile)."""

    @property
    def pod_errors(self) -> int:
        return sum(self.api_errors.values())


@dataclass
class Applied:
    annotations: dict[str, str]
    condition: dict[str, str] | None
    versions: frozenset[str | None] = frozenset()
    """resourceVersions of the pod from just before our writes up to the last of them."""


@dataclass
class Reconciler:
    api: client.ApiClient
    stale_after: timedelta = DEFAULT_STALE_AFTER
    idle_after: timedelta | None = DEFAULT_IDLE_AFTER
    """How long requested GPUs may go unused before the pod is flagged; None: never."""
    instance: str = field(default_factory=socket.gethostname)
    """Names this replica in Events (reportingInstance)."""
    counts: Counts = field(default_factory=Counts)
    _applied: dict[str, Applied] = field(default_factory=dict)
    _echoes: dict[str, str] = field(default_factory=dict)
    """Report name → the resourceVersion our last status write gave it, when that reconcile
    wrote everything it wanted: the watch event of that version only echoes our own write."""

    def __post_init__(self) -> None:
        self._core = client.CoreV1Api(self.api)
        self._custom = client.CustomObjectsApi(self.api)
        self._events = client.EventsV1Api(self.api)

    # -- reports ---------------------------------------------------------------------------
    def is_echo(self, body: Mapping[str, Any]) -> bool:
        """Whether a watch event shows the report exactly as our last reconcile left it.

        Every status write comes back as a watch event. Reconciling it again would find nothing
        to do at the price of a full reconcile (about half the operator's CPU per report
        update). Only watch events may be skipped so: a reconcile for a later time (staleness)
        must run even on the same version.
        """
        meta = body["metadata"]
        version = meta.get("resourceVersion")
        return version is not None and self._echoes.get(meta["name"]) == version

    def reconcile(self, body: dict[str, Any], lookup: PodLookup, now: datetime) -> bool:
        """Bring status and pods in line with one report; True when the report is stale."""
        name = body["metadata"]["name"]
        self._echoes.pop(name, None)
        failures = self.counts.pod_errors
        written: str | None = None
        try:
            spec = GpuNodeUsageSpec.model_validate(body.get("spec") or {})
            previous = (
                GpuNodeUsageStatus.model_validate(body["status"]) if body.get("status") else None
            )
        except ValidationError as exc:
            log.error("GpuNodeUsage %s cannot be read: %s", name, exc)
            return False
        resolutions = list(resolve_all(spec, lookup))
        uses = pod_uses(spec.node_name, spec.observed_at, resolutions)
        fresh = not is_stale(spec.observed_at, now, self.stale_after)
        idle = (
            idle_pods(lookup.requesting_on_node(spec.node_name), uses, now, self.idle_after)
            if fresh and report_is_complete(spec)
            else []
        )
        status = desired_status(
            spec, resolutions, now, generation=body["metadata"].get("generation"),
            previous=previous, stale_after=self.stale_after, idle=[i.entry() for i in idle],
        )  # fmt: skip
        # Pods first: their annotations and condition are what people read, and each write
        # waits on the apiserver; the status follows.
        stale = status.stale
        for use in uses.values():
            self._pod(use.pod, "Unknown" if stale else "InUse", use, spec.node_name, now)
        idle_by_uid = {i.pod.uid: i for i in idle}
        for ref in lookup.on_node_with_our_marks(spec.node_name):
            if ref.uid not in uses and ref.uid not in idle_by_uid:
                self._pod(ref, "Unknown" if stale else "Stopped", None, spec.node_name, now)
        for found in idle:
            self._pod(found.pod, "Idle", None, spec.node_name, now, idle=found)
        wanted = status.to_api()
        if previous is None or previous.to_api() != wanted:
            response = call(
                lambda: raw.body(
                    self._custom.patch_cluster_custom_object_status(
                        names.GROUP,
                        names.VERSION,
                        names.PLURAL,
                        name,
                        {"status": wanted},
                        _preload_content=False,
                    )
                ),
                f"status of {name}",
            )
            self.counts.status_writes += 1
            written = _echo_version(response, body["metadata"].get("generation"))
        if written is not None and self.counts.pod_errors == failures:
            self._echoes[name] = written  # a failed pod write is retried on the echo instead
        return stale

    def forget_node(self, node: str, lookup: PodLookup, now: datetime) -> None:
        """The node's report was deleted: its pods no longer use GPUs as far as we know."""
        self._echoes.pop(node, None)
        for ref in lookup.on_node_with_our_marks(node):
            self._pod(ref, "Stopped", None, node, now)

    # -- pods ------------------------------------------------------------------------------
    def _pod(
        self,
        ref: PodRef,
        state: UseState,
        use: PodUse | None,
        node: str,
        now: datetime,
        *,
        idle: Idle | None = None,
    ) -> None:
        applied = self._applied.get(ref.uid)
        if applied is None or ref.resource_version not in applied.versions:
            applied = Applied(ref.our_annotations, ref.our_condition)
        versions = {ref.resource_version}
        if state == "InUse" and use is not None:
            wanted: dict[str, str] | None = desired_annotations(use)
        elif state == "Unknown":
            wanted = applied.annotations or None  # keep the last known use
        else:
            wanted = None
        condition = desired_condition(state, use, node, idle)
        try:
            patch = annotation_patch(applied.annotations, wanted)
            if patch is not None:
                versions.add(self._write_pod(ref, {"metadata": {"annotations": patch}}, False))
            # An idle pod's condition dates from the start of its idleness, so that the time
            # reads back as the same idle_since on the next reconcile.
            cpatch = condition_patch([applied.condition] if applied.condition else [],
                                     condition, idle.since if idle else now)  # fmt: skip
            if cpatch is not None:
                versions.add(self._write_pod(ref, {"status": {"conditions": [cpatch]}}, True))
                event = event_for(applied.condition, condition)
                if event is not None:
                    self._event(ref, event, f"{event.note}: {condition['message']}", now)
        except NotFound:
            self._applied.pop(ref.uid, None)  # deleted meanwhile: nothing to mark
            return
        except Exception as exc:  # one pod must not stop the others
            self.counts.api_errors[type(exc).__name__] += 1
            log.warning("pod %s/%s: %s", ref.namespace, ref.name, exc)
            return
        if patch is None and cpatch is None:
            return  # nothing written: what the index shows stays the truth
        self._applied[ref.uid] = Applied(
            dict(wanted or {}),
            {**condition, **(cpatch or {})} if cpatch else applied.condition,
            frozenset(versions),
        )

    def _write_pod(self, ref: PodRef, body: dict[str, Any], status: bool) -> str | None:
        """Patch the pod (or its status); the resourceVersion the write produced."""
        # Raw responses: deserialising the returned V1Pod cost more CPU than the rest of the
        # reconcile; only its resourceVersion is needed.
        if status:
            answer = call(
                lambda: raw.body(
                    self._core.patch_namespaced_pod_status(
                        ref.name,
                        ref.namespace,
                        body,
                        _content_type=STRATEGIC,
                        _preload_content=False,
                    )
                ),
                f"pods/status {ref.namespace}/{ref.name}",
            )
        else:
            answer = call(
                lambda: raw.body(
                    self._core.patch_namespaced_pod(
                        ref.name, ref.namespace, body, _preload_content=False
                    )
                ),
                f"pod {ref.namespace}/{ref.name}",
            )
        self.counts.pod_writes += 1
        version = raw.written_metadata(answer).get("resourceVersion")
        return None if version is None else str(version)

    def _event(self, ref: PodRef, what: PodEvent, note: str, now: datetime) -> None:
        event = client.EventsV1Event(
            # kubelet's naming: <object>.<time in ns, hex> (generateName may not end in '.').
            metadata=client.V1ObjectMeta(
                name=f"{ref.name}.{int(now.timestamp() * 1e9):x}"[:253], namespace=ref.namespace
            ),
            event_time=now.astimezone(UTC),
            action="GPUUse",
            reason=what.reason,
            note=note[:1024],
            type=what.type,
            regarding=client.V1ObjectReference(
                api_version="v1", kind="Pod", name=ref.name, namespace=ref.namespace, uid=ref.uid
            ),
            reporting_controller=COMPONENT,
            reporting_instance=self.instance[:128],
        )
        try:
            call(lambda: self._events.create_namespaced_event(ref.namespace, event),
                 f"event on {ref.namespace}/{ref.name}")  # fmt: skip
            self.counts.events += 1
        except Exception as exc:  # an Event is best effort
            log.warning("event on pod %s/%s not recorded: %s", ref.namespace, ref.name, exc)


def _echo_version(response: bytes, generation: int | None) -> str | None:
    """The resourceVersion our status write produced, if that version shows the spec we
    reconciled: an agent write that landed between our read and our write raised the
    generation, and then the event of that version must be reconciled, not skipped."""
    meta = raw.written_metadata(response)
    version = meta.get("resourceVersion")
    if not isinstance(version, str) or generation is None or meta.get("generation") != generation:
        return None
    return version
