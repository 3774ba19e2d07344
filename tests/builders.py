"""The world the tests build, in one place: pods as the API serves them and as the operator's
index keeps them, reports as the operator writes their status, a fake reading's source, and
what the apiserver makes of a merge patch. Tests build from here; none imports another test's
helpers."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.api.models import Source
from gpuusage.settings import add_arguments, resolve
from gpuusage_operator.controller.housekeeping import housekeeping
from gpuusage_operator.controller.reconcile import Counts, Reconciler
from gpuusage_operator.controller.term import Term, new_terms
from gpuusage_operator.controller.triggers import Triggers
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.ha.terms import Terms
from gpuusage_operator.index.keptpods import KeptPods
from gpuusage_operator.index.pods import PodLookup, PodSnapshot, snapshot_keys, snapshot_of
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.namespacewatch import namespace_informer
from gpuusage_operator.informers.policywatch import PolicyState, PolicyWatch
from gpuusage_operator.judge.freshness import Renewal
from gpuusage_operator.policies.noderun import NodeRunner
from gpuusage_operator.policies.run import PolicyRunner
from gpuusage_operator.settings import OperatorSettings
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.podmarker import pod_writer
from tests.fakenvml import gpu_uuid

Kept = TypeVar("Kept")


def fixed(value: Kept) -> Callable[[], Kept]:
    """An accessor that always gives `value`: a part's memory where no terms are wired."""
    return lambda: value


# -- the operator's reconciler, alone ------------------------------------------------------


def reconciler_on(
    api: Any,
    *,
    reports_api: Any = None,
    write_budget: WriteBudget | None = None,
    refresh: Callable[[str, str, str], None] = lambda namespace, name, uid: None,
    renewals: Callable[[str], Renewal | None] = lambda node: None,
    nodes: NodeRunner | None = None,
    terms: Terms[Term] | None = None,
) -> Reconciler:
    """A Reconciler with no pod policies, its writers on `api` (a kubernetes ApiClient), its
    report statuses written through `reports_api` where given, the Leases' renewals from
    `renewals`, the node rules carried out by `nodes`, its memories `terms`' (as main wires
    them: `nodes` is handed its part by the caller)."""
    queue, counts, held = WorkQueue(), Counts(), terms or new_terms()
    marker = pod_writer(
        api,
        counts,
        instance="test",
        write_budget=write_budget or WriteBudget(),
        due=Triggers(queue, lambda: held.current.book).due,
        refresh=refresh,
        memory=lambda: held.current.marks,
        events=lambda: held.current.events,
    )
    return Reconciler(
        api, marker, counts, queue, held, reports_api=reports_api, renewals=renewals, nodes=nodes
    )


def remembered_pods(reconciler: Reconciler) -> set[str]:
    """The pods (by UID) of which the reconciler keeps something in this term: what it wrote
    on them, since when their processes were absent, where it saw them."""
    term = reconciler.terms.current
    return set(term.marks.applied) | set(term.marks.written) | set(term.absent) | set(term.seen_on)


# -- pods as the API serves them ------------------------------------------------------------


def api_pod(
    name: str, uid: str, containers: dict[str, str], ns: str = "ml", gpus: int = 1
) -> dict[str, Any]:
    limits = {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "2"}}
    return {
        "metadata": {"name": name, "namespace": ns, "uid": uid},
        "spec": {
            "nodeName": "gpu-node-a",
            "containers": [{"name": c, "resources": limits} for c in containers],
        },
        "status": {
            "containerStatuses": [
                {"name": cname, "containerID": f"containerd://{cid}"}
                for cname, cid in containers.items()
            ]
        },
    }


def pod_lookup(*pods: dict[str, Any]) -> PodLookup:
    """These pods as the operator's index keeps them, each kept whole."""
    return snapshots_lookup(*(ref for body in pods if (ref := snapshot_of(body)) is not None))


def snapshots_lookup(*refs: PodSnapshot) -> PodLookup:
    kept = KeptPods()
    for ref in refs:
        kept.put(ref)
    return PodLookup(kept)


# -- pods as the operator's index keeps them --------------------------------------------------


def marked_snapshot(devices: str | None, status: str = "True") -> PodSnapshot:
    annotations = ((names.ANNOTATION_GPUS, devices),) if devices else ()
    condition = (
        ("reason", "ProcessesRunning"),
        ("status", status),
        ("type", names.POD_CONDITION_GPU_IN_USE),
    )
    return PodSnapshot("ml", "p", "u-1", "n1", annotations=annotations, condition=condition)


# -- reports as the operator writes their status (what `gpuusage top` reads) ------------------

STATUS_TIME = datetime(2026, 11, 21, 12, 0, tzinfo=UTC).isoformat().replace("+00:00", "Z")


def status_pod(ns: str, name: str, mib: int, pids: list[int], requested: int = 1) -> dict[str, Any]:
    uid = str(uuid.uuid4())
    return {
        "namespace": ns,
        "name": name,
        "uid": uid,
        "usedMemoryMiB": mib,
        "requestedGPUs": requested,
        "unrequested": requested == 0,
        "containers": [{"name": "main", "pids": pids, "usedMemoryMiB": mib}],
    }


def status_report(
    node: str,
    devices: dict[str, list[dict[str, Any]]],
    stale: bool = False,
    idle: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    conditions = [
        {
            "type": "Ready",
            "status": "False" if stale else "True",
            "reason": "Observed",
            "lastTransitionTime": STATUS_TIME,
        },
        {
            "type": "Stale",
            "status": "True" if stale else "False",
            "reason": "Observed",
            "lastTransitionTime": STATUS_TIME,
        },
    ]
    return {
        "metadata": {"name": node},
        "spec": {
            "nodeName": node,
            "observedAt": STATUS_TIME,
            "gpus": [],
            "source": {"kind": "fake", "available": True},
        },
        "status": {
            "conditions": conditions,
            "idlePods": idle or [],
            "pods": [{**p, "deviceUUID": u} for u, ps in devices.items() for p in ps],
        },
    }


# -- scenarios, readings and the apiserver ---------------------------------------------------

FAKE_SOURCE = Source(kind="fake", available=True)
"""A fake GPU source that answered: what a reading of the tests' fake machine says of itself."""


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386's MergePatch, as the apiserver applies it."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


class ReportStatusApi:
    """A GpuNodeUsage's status subresource as the apiserver answers the reconciler (raw, as
    it reads it): a merge patch applied to the stored status, refused with 409 when it names a
    resourceVersion not current."""

    def __init__(self) -> None:
        self.version = 100
        self.writes = 0
        self.refused = 0
        self.bodies: list[dict[str, Any]] = []
        self.status: dict[str, Any] | None = None
        self.generation = 1

    def patch_cluster_custom_object_status(
        self, group: str, version: str, plural: str, name: str, body: dict[str, Any], **_: Any
    ) -> Any:
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != str(self.version):
            self.refused += 1
            raise client.ApiException(status=409, reason="Conflict")
        self.version += 1
        self.writes += 1
        self.bodies.append(body)
        self.status = apply_merge_patch(self.status, body["status"])
        meta = {"name": name, "resourceVersion": str(self.version), "generation": self.generation}
        answer = {"metadata": meta, "status": self.status}
        return SimpleNamespace(data=json.dumps(answer).encode(), release_conn=lambda: None)


class PolicyStatusApi:
    """GpuUsagePolicies' status subresource in dicts, by policy, as the apiserver serves it:
    merge patches (refused with 409 when they name a resourceVersion that is not the latest),
    each answering the object with its resourceVersion; with the faults of a real one: a write
    refused, a write that lands but whose answer is lost, and writes held at `gate` until it is
    set (so that workers overlap). No watch: a test hands the policy's events to its state
    (`served`). For tests of the policies' bookkeeping under faults; what the apiserver keeps
    is proven on it."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.statuses: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, int] = {}
        self.refuse_writes = self.lose_answers = False
        self.writes = self.held = self.attempts = 0
        self.gate = gate
        self._lock = threading.Lock()

    @property
    def status(self) -> dict[str, Any]:
        """The status of the policy "idle" (enforced_policy's)."""
        return self.statuses.get("idle", {})

    def write_elsewhere(self, status: dict[str, Any], name: str = "idle") -> None:
        """Another replica merges this into the status (or a person edits the policy: {})."""
        with self._lock:
            self.statuses[name] = apply_merge_patch(self.statuses.get(name, {}), status)
            self.versions[name] = self.versions.get(name, 1) + 1

    def served(self, policy: dict[str, Any]) -> dict[str, Any]:
        """The policy (as enforced_policy builds it) as the apiserver serves it now, its status
        and resourceVersion this fake's: what its watch event carries."""
        with self._lock:
            answer = self._answer(policy["metadata"]["name"])
        meta = {**policy["metadata"], **answer["metadata"]}
        return {**policy, "metadata": meta, "status": answer["status"]}

    def _answer(self, name: str) -> dict[str, Any]:
        version = str(self.versions.get(name, 1))
        return {"metadata": {"resourceVersion": version}, "status": self.statuses.get(name, {})}

    def patch_cluster_custom_object_status(self, *args: Any) -> Any:
        name, body = args[-2], args[-1]
        with self._lock:
            self.attempts += 1
        if self.gate is not None:
            with self._lock:
                self.held += 1
            self.gate.wait()
        if self.refuse_writes:
            raise ConnectionError("refused")
        with self._lock:
            named = body.get("metadata", {}).get("resourceVersion")
            if named is not None and named != str(self.versions.get(name, 1)):
                raise ApiException(status=409, reason="Conflict")
            self.writes += 1
            self.statuses[name] = apply_merge_patch(self.statuses.get(name, {}), body["status"])
            self.versions[name] = self.versions.get(name, 1) + 1
            answer = self._answer(name)
        if self.lose_answers:
            raise TimeoutError("the answer was lost")
        return answer


def enforced_policy(name: str = "idle", limit: int = 10) -> dict[str, Any]:
    """A GpuUsagePolicy as listed: delete pods holding GPUs idle, at most `limit` an hour."""
    return {
        "metadata": {"name": name, "generation": 1},
        "spec": {
            "maxActionsPerHour": limit,
            "rules": [{"finding": "HoldingIdleGPU", "action": "DeletePod", "mode": "Enforce"}],
        },
    }


def policy_watch(state: PolicyState) -> PolicyWatch:
    """A PolicyWatch, listed, over these policies (a test hands their events to `state`, and
    sets `node_rule` where it needs); it watches nothing."""
    watch = PolicyWatch(custom=None, namespaces=namespace_informer(None))
    watch.policies.state = state
    for listed in (watch.policies.synced, watch.namespaces.synced, watch.decided):
        listed.set()
    watch.available.set()
    return watch


def listed_again(watch: PolicyWatch, *policies: dict[str, Any]) -> None:
    """The policies' watch broke and listed them again, finding these: the informer's own
    list, whose state replaces the one it had."""
    page = {"metadata": {"resourceVersion": "1"}, "items": list(policies)}
    answer = SimpleNamespace(data=json.dumps(page).encode(), release_conn=lambda: None)
    watch.policies._list_page = lambda limit, token: answer
    watch.policies.synced.clear()
    watch.policies.list_all()


def policy_runner(
    api: PolicyStatusApi, clock: Callable[[], datetime], *, limit: int = 10, cluster: int = 30
) -> tuple[PolicyRunner, PolicyState]:
    """The pods' policy runner over one enforced policy whose status lives in `api`, with the
    state of its watch (to tell it of the policy's changes)."""
    state = PolicyState()
    state.apply("ADDED", api.served(enforced_policy(limit=limit)))
    runner = PolicyRunner(
        watch=policy_watch(state),
        custom=api,
        annotate=lambda pod, patch: True,
        record=lambda *a: None,
        clock=clock,
        cluster_actions_per_hour=cluster,
    )
    return runner, state


def one_process_scenario(path: Path, used: int) -> None:
    """A scenario file of one GPU with one process using `used` MiB (the fake source's)."""
    path.write_text(
        yaml.safe_dump(
            {
                "gpus": [
                    {
                        "index": 0,
                        "uuid": gpu_uuid(0),
                        "memoryTotalMiB": 1000,
                        "processes": [{"pid": 5, "usedMemoryMiB": used}],
                    }
                ]
            }
        )
    )


def index_keys(body: dict[str, Any]) -> tuple[str, ...]:
    """The keys the pod index finds this pod under besides its UID."""
    ref = snapshot_of(body)
    return () if ref is None else snapshot_keys(ref)


def deadline_entries(queue: WorkQueue) -> int:
    """The deadline entries a work queue holds (about one per name with a deadline): what
    its memory grows with."""
    return len(queue._waiting)


class Clock:
    """A clock a test moves by hand (`now`)."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now


def tainting_runner(
    api: PolicyStatusApi, clock: Callable[[], datetime], limit: int = 10
) -> PolicyRunner:
    """The policy runner of one enforced policy ("idle", its status in `api`) whose node rule
    taints a node with orphaned memory at once."""
    runner, state = policy_runner(api, clock, limit=limit)
    rule = {"finding": "OrphanedGPUMemory", "after": "0s", "action": "Taint", "mode": "Enforce"}
    policy = enforced_policy(limit=limit)
    policy["metadata"]["generation"] = 2
    policy["spec"]["nodeRules"] = [rule]
    state.apply("MODIFIED", api.served(policy))
    found = state.policies["idle"]
    cast(Any, runner.watch).node_rule = lambda: (found, found.spec.node_rules[0])
    return runner


def resolved_operator(*flags: str) -> OperatorSettings:
    """The operator's settings from these flags alone (no environment)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, OperatorSettings)
    return resolve(OperatorSettings, parser.parse_args(list(flags)), environ={})


def run_housekeeping(
    reconciler: Reconciler,
    monkeypatch: Any,
    done: Callable[[], bool],
    *,
    known: Callable[[], set[str]] = set,
    probed: Callable[[], object] = lambda: None,
) -> None:
    """The housekeeping pass in-process, every millisecond, until `done()` (10 s at most): the
    API probe answered by a stand-in that calls `probed` at each pass; this replica leads, the
    indexes are synced, no pod carries marks, the reports named are `known()`'s. The pass runs
    on the apiserver in every on-cluster test."""

    def probe(*args: object, **kwargs: object) -> dict[str, Any]:
        probed()
        return {"items": []}

    monkeypatch.setattr(
        client, "CustomObjectsApi", lambda api: SimpleNamespace(list_cluster_custom_object=probe)
    )

    async def active() -> bool:
        return True

    async def run() -> None:
        lookup = SimpleNamespace(nodes_with_our_marks=set)
        task = asyncio.create_task(
            housekeeping(
                reconciler,
                cast(Any, SimpleNamespace(lookup=lambda: lookup)),
                0.001,
                cast(Any, SimpleNamespace(active=active)),
                health=ApiHealth(),
                known=known,
                ready=lambda: True,
            )
        )
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(run())
