"""Marking pods: what the operator writes on a pod (its gpuusage.io/ annotations and the
GPUInUse condition, the Events of transitions), and what it remembers having written.

What each pod should carry is the judge's (a verdict's marks, see judge.podstate); the patch
from what it shows is marks.plan_pod's; this module sends it: every write carries the UID it
was decided for, draws from the cluster-wide budget (see budget), and is remembered only
while the pod's resourceVersion shows it, so that what a pod carries, not what was last sent,
is compared with what it should carry.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as TallyCounter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from kubernetes import client

from gpuusage.api import names
from gpuusage.kube import raw
from gpuusage.kube.core import CoreApi, EventApi
from gpuusage.kube.errors import Forbidden, Invalid, NotFound, NotLeading, is_other_object, retried
from gpuusage.kube.rest import STRATEGIC
from gpuusage_operator.index.pods import PodSnapshot, pod_marks
from gpuusage_operator.judge.podstate import Verdict
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.eventbook import EventBook
from gpuusage_operator.writers.events import COMPONENT, EventCounts, EventRecorder
from gpuusage_operator.writers.marks import PodEvent, plan_pod, shows

log = logging.getLogger(__name__)


class MarkCounts(EventCounts, Protocol):
    pod_writes: int
    uid_refusals: int
    writes_deferred: int
    api_errors: TallyCounter[str]

    def failed(self, kind: str) -> None:
        """A pod write failed with this kind of error (safe from any thread)."""


@dataclass(frozen=True, slots=True)
class Applied:
    annotations: dict[str, str]
    condition: dict[str, str] | None
    versions: frozenset[str | None] = frozenset()
    """resourceVersions of the pod from just before our writes up to the last of them."""


@dataclass(slots=True)
class MarkMemory:
    """What the marker remembers of the pods it wrote on, for one term (controller.term):
    another replica may have written on them since this one last led."""

    applied: dict[str, Applied] = field(default_factory=dict)
    """Pod UID → what it showed after our last writes, and their versions."""
    resumed: dict[str, str] = field(default_factory=dict)
    """Pod UID → the reason its condition had (True or False) before this replica turned it
    Unknown: the pod known again as it was is no event (a finding gets no second Warning)."""
    written: dict[str, dict[str, str]] = field(default_factory=dict)
    """Pod UID → our annotations as this replica last wrote them (empty: removed). Unlike
    `applied`, kept when someone else edits the pod: an Unknown pod keeps the last known use
    as the operator wrote it, not what someone wrote over it since (see plan_pod)."""

    refused: bool = False
    """A write of ours was refused for want of the right to write pods (an install with pod
    marks off): marks are not tried again this term."""

    def forget(self, uid: str) -> None:
        self.applied.pop(uid, None)
        self.written.pop(uid, None)
        self.resumed.pop(uid, None)


@dataclass(frozen=True, slots=True)
class Marked:
    """What a pod shows once marked."""

    condition: dict[str, Any]
    """Its GPUInUse condition."""
    due: datetime | None = None
    """When detail held back (see marks.held_detail) is to be shown."""


@dataclass
class PodMarker:
    """Sends plan_pod's writes; remembers, per pod UID, what it wrote."""

    core: Any
    """A CoreV1Api."""
    counts: MarkCounts
    events: EventRecorder
    memory: Callable[[], MarkMemory]
    """What it remembers, the term's (controller.term)."""
    write_budget: WriteBudget = field(default_factory=WriteBudget)
    """Pod writes across all reports: over it, a pod's writes wait for the next reconcile of
    its report, which `due` makes due."""
    monotonic: Callable[[], float] = time.monotonic
    due: Callable[[set[str]], None] = lambda nodes: None
    refresh: Callable[[str, str, str], None] = lambda namespace, name, stale_uid: None
    """Reads one pod into the index again: called when a write was refused because the pod
    of that name is now another one."""

    def wrote(self, uid: str, version: str | None) -> bool:
        """Whether this version of the pod is (the echo of) one of our writes."""
        applied = self.memory().applied.get(uid)
        return applied is not None and version in applied.versions

    def forget(self, uid: str) -> None:
        """The pod is gone: nothing of it is kept."""
        self.memory().forget(uid)

    def _remember_spell(
        self, uid: str, before: dict[str, str] | None, after: dict[str, Any]
    ) -> None:
        """A condition written: turned Unknown from a known state, the reason it had is kept
        for when the pod is known again; known again (True or False), the spell is over."""
        status = after.get("status")
        resumed = self.memory().resumed
        if status != "Unknown":
            resumed.pop(uid, None)
        elif before is not None and before.get("status") in ("True", "False"):
            resumed[uid] = before.get("reason", "")

    def mark(self, verdict: Verdict, node: str, now: datetime) -> Marked | None:
        """Apply plan_pod's writes to one pod, then record what the pod now shows; the
        condition it shows and when detail held back is due (None when the writes failed or
        the pod is gone)."""
        ref = verdict.pod
        memory = self.memory()
        applied = memory.applied.get(ref.uid)
        # Our condition gone from the pod (removed by hand) is put back as it was, with its
        # transition time and no Event: nothing happened to the pod's GPU use.
        remembered = applied.condition if applied is not None and not ref.condition else None
        if applied is None or ref.resource_version not in applied.versions:
            applied = Applied(ref.our_annotations, ref.our_condition)
        if verdict.marks is None:
            raise ValueError(f"pod {ref.namespace}/{ref.name}: a verdict with no marks to write")
        plan = plan_pod(
            verdict.marks,
            applied.annotations,
            applied.condition,
            now,
            remembered=remembered,
            known=memory.written.get(ref.uid),
            resumed=memory.resumed.get(ref.uid),
        )
        versions = {ref.resource_version}
        writes = (plan.annotation_patch is not None) + (plan.condition_patch is not None)
        if writes and not self.admit(node, writes):
            return None
        answer: dict[str, Any] = {}
        try:
            if plan.annotation_patch is not None:
                annotations = {"metadata": {"annotations": plan.annotation_patch}}
                answer = self.write(ref, annotations, False)
                versions.add(_version(answer))
            if plan.condition_patch is not None:
                conditions = {"status": {"conditions": [plan.condition_patch]}}
                answer = self.write(ref, conditions, True)
                versions.add(_version(answer))
                if plan.event is not None:
                    self.record_event(ref, plan.event, plan.event_note, now)
        except NotFound:
            self.forget(ref.uid)  # deleted meanwhile: nothing to mark
            return None
        except NotLeading:
            return None  # the replica that leads writes it (see ha.fence): no failure
        except Invalid as exc:
            if not is_other_object(exc):
                self.counts.failed(type(exc).__name__)
                log.warning("pod %s/%s: %s", ref.namespace, ref.name, exc)
                return None
            # The pod of this name is not the one decided for (deleted and recreated under
            # the same name while the index lagged): nothing was written to it. Read it again
            # and leave it to the next report, instead of retrying what was meant for another.
            memory.applied.pop(ref.uid, None)
            self.counts.add("uid_refusals")
            log.info(
                "pod %s/%s is no longer %s; reading it again", ref.namespace, ref.name, ref.uid
            )
            try:
                self.refresh(ref.namespace, ref.name, ref.uid)
            except Exception as error:  # the watch's next list brings it in all the same
                log.warning("pod %s/%s: cannot read it again: %s", ref.namespace, ref.name, error)
            return None
        except Exception as exc:  # one pod must not stop the others; tried again next pass
            self.counts.failed(type(exc).__name__)
            log.warning("pod %s/%s: %s", ref.namespace, ref.name, exc)
            self.due({node})
            return None
        if plan.annotation_patch is not None:
            memory.written[ref.uid] = dict(plan.annotations)
        if plan.condition_patch is not None:
            self._remember_spell(ref.uid, applied.condition, plan.condition)
        if plan.annotation_patch is None and plan.condition_patch is None:
            return Marked(plan.condition, plan.due)  # nothing written: the index stays the truth
        annotated, condition = pod_marks(answer)
        if answer and not shows(dict(annotated), dict(condition) if condition else None, plan):
            # Someone else edited the pod's marks while we wrote (between our two writes,
            # or before the first): none of these versions shows our plan, so none is taken
            # for our echo, and the next pass compares what the pod then carries.
            versions = set()
            self.due({node})
        memory.applied[ref.uid] = Applied(
            dict(plan.annotations), dict(plan.condition), frozenset(versions)
        )
        return Marked(plan.condition, plan.due)

    def admit(self, node: str | None, writes: int = 1) -> bool:
        """Whether the cluster-wide budget allows these pod writes now (they are taken from
        it); over it, the writes wait and the node's report is reconciled at the next pass."""
        if self.write_budget.take(self.monotonic(), writes):
            return True
        self.counts.add("writes_deferred")
        if node:
            self.due({node})
        return False

    def admit_pod(self, ref: PodSnapshot) -> bool:
        """admit for one write on this pod (a policy's announcement)."""
        return self.admit(ref.node)

    def annotate(self, ref: PodSnapshot, patch: dict[str, str | None]) -> bool:
        """Patch annotations of a pod decided for (its UID a precondition) after `admit`
        allowed the write; whether it landed (a failure is counted and logged, and the next
        reconcile decides again). Its echo is known as ours where the pod showed what this
        replica last applied (as `mark` knows its own), so it costs no reconcile."""
        try:
            answer = self.write(ref, {"metadata": {"annotations": patch}}, False)
        except NotFound:
            self.forget(ref.uid)  # deleted meanwhile: nothing to announce
            return False
        except Exception as exc:
            self.counts.failed(type(exc).__name__)
            log.warning("pod %s/%s: %s", ref.namespace, ref.name, exc)
            return False
        memory = self.memory()
        applied = memory.applied.get(ref.uid)
        version = _version(answer)
        if applied is None or version is None or ref.resource_version not in applied.versions:
            return True  # what the pod shows is the index's to tell
        annotated, condition = pod_marks(answer)
        carried, shown = dict(annotated), dict(condition)
        wanted = {**applied.annotations, **patch}
        if all(carried.get(k) == v for k, v in wanted.items()) and all(
            shown.get(k) == v for k, v in (applied.condition or {}).items()
        ):
            memory.applied[ref.uid] = replace(applied, versions=applied.versions | {version})
        else:  # edited by someone else meanwhile: the next pass compares what it carries
            memory.applied.pop(ref.uid, None)
        return True

    def clear(self, ref: PodSnapshot) -> bool:
        """Remove what the operator wrote on a pod, a policy's announcement too (no Event:
        nothing was observed); whether it came off. Where this install may not write pods
        (403), nothing more is tried for the rest of the term: `refused` says so."""
        shown = ref.our_annotations
        patch = {k: None for k in names.OPERATOR_ANNOTATIONS if k in shown} or None
        writes = (patch is not None) + (ref.our_condition is not None)
        if self.memory().refused:
            return False
        if writes and not self.admit(ref.node, writes):
            return False  # over the budget: cleared when its node is looked at again
        try:
            if patch is not None:
                self.write(ref, {"metadata": {"annotations": patch}}, False)
            if ref.our_condition is not None:
                gone = {"type": names.POD_CONDITION_GPU_IN_USE, "$patch": "delete"}
                self.write(ref, {"status": {"conditions": [gone]}}, True)
        except NotFound:
            pass  # deleted: nothing of ours on it
        except Invalid as exc:
            if not is_other_object(exc):
                self.counts.failed(type(exc).__name__)
                log.warning("pod %s/%s: %s", ref.namespace, ref.name, exc)
                return False
            # replaced by another pod of that name: nothing of ours on it
        except Forbidden as exc:
            if no_right(exc):  # the install's RBAC: nothing more is tried this term
                self.memory().refused = True
            else:  # one pod refused (an admission webhook): the others are tried
                self.counts.failed(type(exc).__name__)
            log.warning("pod %s/%s: may not be written: %s", ref.namespace, ref.name, exc)
            return False
        except Exception as exc:  # one pod must not stop the others
            self.counts.failed(type(exc).__name__)
            log.warning("pod %s/%s: %s", ref.namespace, ref.name, exc)
            return False
        self.forget(ref.uid)
        return True

    @property
    def refused(self) -> bool:
        """Whether a removal of marks was refused for want of the right to write pods, in this
        term."""
        return self.memory().refused

    def write(self, ref: PodSnapshot, body: dict[str, Any], status: bool) -> dict[str, Any]:
        """Patch the pod (or its status); the pod as the write left it (empty where the
        answer was not a pod).

        The patch carries the UID the decision was made for: the apiserver refuses a patch
        whose metadata.uid differs from the stored pod's (422, the field is immutable), so a
        pod recreated under the same name never receives its predecessor's marks.
        """
        body = {**body, "metadata": {**body.get("metadata", {}), "uid": ref.uid}}
        # Raw responses: deserialising the returned V1Pod cost more CPU than the rest of the
        # reconcile; only its resourceVersion is needed.
        if status:
            answer = retried(
                lambda: raw.body(
                    self.core.patch_namespaced_pod_status(
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
            answer = retried(
                lambda: raw.body(
                    self.core.patch_namespaced_pod(
                        ref.name, ref.namespace, body, _preload_content=False
                    )
                ),
                f"pod {ref.namespace}/{ref.name}",
            )
        self.counts.add("pod_writes")
        return raw.written_object(answer)

    def record_event(self, ref: PodSnapshot, what: PodEvent, note: str, now: datetime) -> None:
        """An Event about the pod (see writers.events: new, a series, or dropped)."""
        regarding = client.V1ObjectReference(
            api_version="v1", kind="Pod", name=ref.name, namespace=ref.namespace, uid=ref.uid
        )
        self.events.record(ref.namespace, regarding, what, note, now)

    def record_node_event(self, node: str, what: PodEvent, note: str, now: datetime) -> None:
        """An Event about a Node, in the default namespace (where the kubelet records its
        node's Events, and where `kubectl describe node` finds them)."""
        regarding = client.V1ObjectReference(api_version="v1", kind="Node", name=node)
        self.events.record("default", regarding, what, note, now)


def pod_writer(
    api: client.ApiClient,
    counts: MarkCounts,
    *,
    instance: str,
    write_budget: WriteBudget,
    due: Callable[[set[str]], None],
    refresh: Callable[[str, str, str], None],
    memory: Callable[[], MarkMemory],
    events: Callable[[], EventBook],
) -> PodMarker:
    """The pod writer on one API client, with its Event recorder: `instance` names this
    replica in its Events, `due` queues reports, `refresh` reads a pod into the index again;
    `memory` and `events` give the term's memories of the pods and the Events."""
    recorder = EventRecorder(EventApi(api), counts, instance, COMPONENT, events)
    return PodMarker(CoreApi(api), counts, recorder, memory, write_budget, due=due, refresh=refresh)


def _version(pod: dict[str, Any]) -> str | None:
    version = (pod.get("metadata") or {}).get("resourceVersion")
    return None if version is None else str(version)


def no_right(error: Exception) -> bool:
    """Whether a 403 is RBAC's (the identity may not patch pods at all), not an admission
    webhook's refusal of one pod: RBAC says `... cannot patch resource "pods" ...`."""
    return "cannot patch resource" in str(error)
