"""Policies on the real control plane: announced first (the pod's annotation and a Warning
Event with the deadline), a dry run recorded once and nothing done, a Notify carried out, an
exempt pod left alone, an announcement cancelled when its finding clears, the decisions in
the policy's status, the ledger's counts on the status subresource, a ScaleToZero that
a GitOps tool or an autoscaler would undo left undone, and nothing done where the operator
writes on no pod (pod marks off, a namespace outside its selector)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage_operator.informers.policywatch import PolicyState
from gpuusage_operator.policies.ledger import STATUS_RETRY, PolicyLedger, Slot
from gpuusage_operator.writers.budget import WriteBudget
from tests.builders import policy_watch
from tests.conftest import GPU0, GPU1, Kubectl, WorldFactory, wait_for
from tests.fakenvml import gpu_uuid
from tests.simworld import SimWorld
from tests.workloads import KEDA_OWNED, autoscaler, deployment_of, replicas, scaled_object_ref
from tests.worldview import (
    condition,
    create_policy,
    events,
    in_namespace,
    pod,
    pod_annotations,
    report,
    scrape,
)

pytestmark = pytest.mark.cluster

PolicyMaker = Callable[[str, dict[str, Any]], dict[str, Any]]


def _scenario(world: SimWorld, notebook_sm: int) -> None:
    pids = world.pids
    world.scenario(
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [
                    {"pid": pids["train"], "usedMemoryMiB": 30720, "smUtil": 70},
                    {"pid": pids["sneaky"], "usedMemoryMiB": 2048, "smUtil": 20},
                ],
            },
            {
                "index": 1,
                "uuid": GPU1,
                "memoryTotalMiB": 81920,
                "processes": [
                    {"pid": pids["notebook"], "usedMemoryMiB": 71680, "smUtil": notebook_sm}
                ],
            },
            {
                "index": 2,
                "uuid": gpu_uuid(2),
                "memoryTotalMiB": 81920,
                "processes": [{"pid": pids["lab"], "usedMemoryMiB": 40960, "smUtil": 0}],
            },
        ]
    )


EXEMPT = {"annotations": {names.ANNOTATION_EXEMPT: "true"}}


def _world(make_world: WorldFactory, exempt_pod: str, notebook_sm: int) -> SimWorld:
    """The four pods of `_scenario` on it, one of them annotated exempt by its owner; short
    idle and notice times so that policies decide within a test."""
    world = make_world(
        {"train": 1, "notebook": 1, "lab": 1, "sneaky": 0},
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
        operator_extras={"policy_notice": 2.0},
        pod_extras={exempt_pod: EXEMPT},
    )
    _scenario(world, notebook_sm=notebook_sm)
    return world


@pytest.fixture
def policy(api: client.ApiClient) -> Iterator[PolicyMaker]:
    """Creates policies (deleted afterwards: other tests' operators would apply them)."""
    made: list[str] = []

    def make(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        made.append(name)
        return create_policy(api, name, spec)

    yield make
    for name in made:
        client.CustomObjectsApi(api).delete_cluster_custom_object(
            names.GROUP, names.VERSION, names.POLICY_PLURAL, name
        )


def _announcement(world: SimWorld, name: str) -> dict[str, Any] | None:
    text = pod_annotations(world, name).get(names.ANNOTATION_POLICY_ACTION)
    return json.loads(text) if text else None


def _status(api: client.ApiClient, name: str) -> dict[str, Any]:
    body: Any = client.CustomObjectsApi(api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, name
    )
    return dict(body.get("status") or {})


def test_a_dry_run_announces_records_once_and_does_nothing(
    make_world: WorldFactory, api: client.ApiClient, policy: PolicyMaker
) -> None:
    world = _world(make_world, exempt_pod="lab", notebook_sm=0)
    name = f"reclaim-{world.ns}"
    policy(
        name,
        {
            "namespaceSelector": in_namespace(world.ns),
            "rules": [
                {"finding": "HoldingIdleGPU", "after": "1s", "action": "ScaleToZero"},
                {
                    "finding": "UsingUnrequestedGPU",
                    "after": "1s",
                    "action": "Notify",
                    "mode": "Enforce",
                },
            ],
        },
    )
    announced = wait_for(lambda: _announcement(world, "notebook"), what="the announcement")
    assert (announced["policy"], announced["finding"], announced["action"]) == (
        name,
        "HoldingIdleGPU",
        "ScaleToZero",
    )
    assert announced["mode"] == "DryRun"
    wait_for(lambda: "GPUPolicyPending" in events(world, "notebook"), what="the warning")
    wait_for(lambda: "GPUPolicyDryRun" in events(world, "notebook"), timeout=60, what="dry run")
    wait_for(lambda: "GPUPolicyNotice" in events(world, "sneaky"), timeout=60, what="notice")

    def outcomes() -> list[tuple[str, str]]:
        listed = _status(api, name).get("decisions") or []
        return sorted((d["target"]["name"], d["outcome"]) for d in listed)

    wait_for(
        lambda: (
            outcomes()
            == [
                ("notebook", "DryRun"),
                ("notebook", "Pending"),
                ("sneaky", "Done"),
                ("sneaky", "Pending"),
            ]
        ),
        what="the decisions in the policy's status",
    )
    status = _status(api, name)
    assert (status["mode"], status["actionsTaken"]) == ("Mixed", 1)
    counted = scrape(world.metrics_port)
    for action, outcome in (("ScaleToZero", "DryRun"), ("Notify", "Done")):
        series = (
            f'gpuusage_operator_policy_decisions_total{{action="{action}",outcome="{outcome}",'
            f'policy="{name}"}} 1.0'
        )
        assert series in counted, counted
    assert status["rules"] == "HoldingIdleGPU>ScaleToZero,UsingUnrequestedGPU>Notify"
    # Nothing was done to the pod, and the dry run is recorded once.
    counts = world.reconciler.counts
    seen = counts.reconciles
    wait_for(lambda: counts.reconciles >= seen + 3, what="more reconciles")
    assert events(world, "notebook").count("GPUPolicyDryRun") == 1
    meta: Any = pod(world, "notebook").metadata
    assert meta.deletion_timestamp is None
    # The exempt pod, idle too, is left alone; the computing trainer is never announced.
    assert _announcement(world, "lab") is None
    assert _announcement(world, "train") is None
    assert not [e for e in events(world, "lab") if e.startswith("GPUPolicy")]

    _scenario(world, notebook_sm=60)  # the notebook computes again: the finding clears
    wait_for(lambda: _announcement(world, "notebook") is None, what="the announcement gone")
    wait_for(lambda: "GPUPolicyCancelled" in events(world, "notebook"), what="cancelled")

    # The sneaky pod's notice was given (enforced, done): when its misuse ends, its
    # announcement goes quietly, as nothing is called off.
    pids = world.pids
    train = {"pid": pids["train"], "usedMemoryMiB": 30720, "smUtil": 70}
    world.scenario([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": [train]}])
    wait_for(lambda: _announcement(world, "sneaky") is None, what="the done one removed")
    assert "GPUPolicyCancelled" not in events(world, "sneaky")


def _notes(world: SimWorld, name: str, reason: str) -> list[str]:
    listed = client.EventsV1Api(world.api).list_namespaced_event(world.ns)
    return [
        str(e.note)
        for e in listed.items
        if e.regarding and e.regarding.name == name and e.reason == reason
    ]


def test_a_tenant_annotating_their_pod_exempt_escapes_no_policy_that_ignores_it(
    make_world: WorldFactory, api: client.ApiClient, policy: PolicyMaker
) -> None:
    """The sneaky pod's owner wrote gpuusage.io/exempt on it; a policy with podOptOut: Ignored
    announces and acts all the same, and does not tell the owner to annotate the pod. The
    namespace's opt-out still counts: it calls off what was announced."""
    world = _world(make_world, exempt_pod="sneaky", notebook_sm=60)
    name = f"misuse-{world.ns}"
    policy(
        name,
        {
            "namespaceSelector": in_namespace(world.ns),
            "podOptOut": "Ignored",
            "rules": [
                {
                    "finding": "UsingUnrequestedGPU",
                    "after": "1s",
                    "action": "Notify",
                    "mode": "Enforce",
                },
                {"finding": "HoldingIdleGPU", "after": "1h", "action": "ScaleToZero"},
            ],
        },
    )
    announced = wait_for(lambda: _announcement(world, "sneaky"), what="the exempt pod announced")
    assert (announced["policy"], announced["finding"]) == (name, "UsingUnrequestedGPU")
    wait_for(lambda: "GPUPolicyNotice" in events(world, "sneaky"), timeout=60, what="notice")
    warning = wait_for(lambda: _notes(world, "sneaky", "GPUPolicyPending"), what="the warning")
    assert "annotate the pod" not in warning[0], warning
    assert "only its namespace's opts out" in warning[0], warning
    assert pod_annotations(world, "sneaky")[names.ANNOTATION_EXEMPT] == "true"

    # The idle lab pod is announced (due in an hour); its namespace opts out: called off.
    wait_for(lambda: _announcement(world, "lab"), what="the idle pod announced")
    world.core.patch_namespace(world.ns, {"metadata": EXEMPT})
    wait_for(lambda: _announcement(world, "lab") is None, what="the announcement called off")
    cancelled = wait_for(
        lambda: _notes(world, "lab", "GPUPolicyCancelled"), what="the cancellation Event"
    )
    assert "opted out" in cancelled[0], cancelled


def test_enforced_actions_stop_at_the_policys_rate_limit(
    make_world: WorldFactory, api: client.ApiClient, policy: PolicyMaker
) -> None:
    """Two ownerless pods hold GPUs idle under an enforced DeletePod with one action per hour:
    one is deleted, the other waits (RateLimited, a Warning Event, its announcement due an
    hour after the first action), and the status keeps the action's time for the limit."""
    world = make_world(
        {"train": 1, "notebook": 1, "lab": 1, "sneaky": 0},
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
        operator_extras={"policy_notice": 1.0, "policy_actions": True},
    )
    _scenario(world, notebook_sm=0)
    name = f"limit-{world.ns}"
    policy(
        name,
        {
            "namespaceSelector": in_namespace(world.ns),
            "maxActionsPerHour": 1,
            "rules": [
                {"finding": "HoldingIdleGPU", "action": "DeletePod", "mode": "Enforce"},
            ],
        },
    )

    def outcome(pod_name: str) -> set[str]:
        listed = _status(api, name).get("decisions") or []
        return {d["outcome"] for d in listed if d["target"]["name"] == pod_name}

    wait_for(
        lambda: {"Done", "RateLimited"} <= outcome("notebook") | outcome("lab"),
        timeout=120,  # 10-20 s alone; a loaded full run took longer than 60 s twice
        what="one pod deleted, the other rate-limited",
    )
    deleted = "notebook" if "Done" in outcome("notebook") else "lab"
    waiting = "lab" if deleted == "notebook" else "notebook"
    assert "Done" not in outcome(waiting)
    gone: Any = pod(world, deleted).metadata
    kept: Any = pod(world, waiting).metadata
    assert gone.deletion_timestamp is not None
    assert kept.deletion_timestamp is None
    assert "GPUPolicyRateLimited" in events(world, waiting)
    status = _status(api, name)
    assert status["actionsTaken"] == 1
    assert len(status["actedAt"]) == 1
    announced = _announcement(world, waiting)
    assert announced is not None
    acted = datetime.fromisoformat(status["actedAt"][0].replace("Z", "+00:00"))
    due = datetime.fromisoformat(announced["due"].replace("Z", "+00:00"))
    assert due - acted == timedelta(hours=1)


def test_an_enforced_scale_to_zero_leaves_what_a_neighbour_would_undo_and_says_why(
    make_world: WorldFactory, api: client.ApiClient, policy: PolicyMaker
) -> None:
    """Four idle pods, each of its own Deployment, under an enforced ScaleToZero: the ones
    Argo CD tracks, Flux applies or KEDA's autoscaler scales keep their replica, decided
    ManagedElsewhere in the policy's status with a Warning Event naming who would undo it; the
    one nobody else keeps is scaled to zero, as ever."""
    pods = ("argo", "flux", "keda", "plain")
    world = make_world(
        dict.fromkeys(pods, 1),
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
        operator_extras={"policy_notice": 1.0, "policy_actions": True},
    )
    world.scenario(
        [
            {
                "index": i,
                "uuid": gpu_uuid(i),
                "memoryTotalMiB": 81920,
                "processes": [{"pid": world.pids[name], "usedMemoryMiB": 8192, "smUtil": 0}],
            }
            for i, name in enumerate(pods)
        ]
    )
    tracking = {"argocd.argoproj.io/tracking-id": f"shop:apps/Deployment:{world.ns}/argo"}
    flux = {
        "kustomize.toolkit.fluxcd.io/name": "apps",
        "kustomize.toolkit.fluxcd.io/namespace": "flux-system",
    }
    deployment_of(api, world.ns, "argo", "argo", annotations=tracking)
    deployment_of(api, world.ns, "flux", "flux", labels=flux)
    deployment_of(api, world.ns, "keda", "keda")
    autoscaler(
        api, world.ns, "keda-hpa-keda", "keda", labels=KEDA_OWNED, owner=scaled_object_ref("keda")
    )
    deployment_of(api, world.ns, "plain", "plain")
    name = f"reclaim-{world.ns}"
    rule = {"finding": "HoldingIdleGPU", "after": "1s", "action": "ScaleToZero"}
    policy(
        name, {"namespaceSelector": in_namespace(world.ns), "rules": [{**rule, "mode": "Enforce"}]}
    )

    def decided() -> dict[str, str]:
        listed = _status(api, name).get("decisions") or []
        return {d["target"]["name"]: d["outcome"] for d in listed if d["outcome"] != "Pending"}

    elsewhere = "ManagedElsewhere"
    wait_for(
        lambda: (
            decided() == {"argo": elsewhere, "flux": elsewhere, "keda": elsewhere, "plain": "Done"}
        ),
        timeout=120,
        what="each pod's decision",
    )
    for kept in ("argo", "flux", "keda"):
        assert replicas(api, world.ns, "Deployment", kept) == 1, kept
    assert replicas(api, world.ns, "Deployment", "plain") == 0
    assert _status(api, name)["actionsTaken"] == 1
    said = {
        "argo": "Argo CD tracks it (annotation argocd.argoproj.io/tracking-id)",
        "flux": "Flux's Kustomization flux-system/apps applies it",
        "keda": "KEDA's ScaledObject keda scales it (HorizontalPodAutoscaler keda-hpa-keda)",
    }
    for kept, who in said.items():

        def told(pod_name: str = kept) -> list[str]:
            return _notes(world, pod_name, "GPUPolicyManagedElsewhere")

        (note,) = wait_for(told, what="the Event")
        where = f"Deployment {world.ns}/{kept}"
        assert f"would scale its workload to zero, but {where} is managed elsewhere: {who}" in note
        assert note.endswith("; nothing done"), note
    (acted,) = _notes(world, "plain", "GPUPolicyActed")
    assert acted.endswith(f"scaled Deployment {world.ns}/plain to zero"), acted


@pytest.mark.parametrize(
    "scope",
    [{"pod_marks": False}, {"namespace_selector": "gpuusage-test=in"}],
    ids=["pod-marks-off", "outside-the-selector"],
)
def test_an_enforced_policy_does_nothing_where_the_operator_writes_on_no_pod_and_says_so(
    make_world: WorldFactory,
    api: client.ApiClient,
    policy: PolicyMaker,
    caplog: pytest.LogCaptureFixture,
    scope: dict[str, Any],
) -> None:
    """Observe first (--no-pod-marks), or a namespace outside --namespace-selector: an enforced
    DeletePod covering a pod that holds its GPU idle neither announces, acts, nor records an
    Event on it, nor a decision in its status, though the report's status carries the
    finding; the operator's log says why. A namespace that comes into the selector is acted
    on as any other."""
    caplog.set_level(logging.WARNING, logger="gpuusage_operator.controller.housekeeping")
    world = make_world(
        {"train": 1, "notebook": 1, "lab": 1, "sneaky": 0},
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
        operator_extras={"policy_notice": 1.0, "policy_actions": True, **scope},
    )
    _scenario(world, notebook_sm=0)
    name = f"observed-{world.ns}"
    policy(
        name,
        {
            "namespaceSelector": in_namespace(world.ns),
            "rules": [
                {
                    "finding": "HoldingIdleGPU",
                    "after": "1s",
                    "action": "DeletePod",
                    "mode": "Enforce",
                },
            ],
        },
    )
    held = wait_for(
        lambda: [
            p["heldIdleSince"]
            for p in (report(world).get("status") or {}).get("pods") or []
            if p["name"] == "notebook" and p.get("heldIdleSince")
        ],
        what="the status carries the finding",
    )
    since = datetime.fromisoformat(held[0].replace("Z", "+00:00"))
    wait_for(
        lambda: [r for r in caplog.records if r.getMessage().startswith(f"policy {name}")],
        timeout=30,
        what="the log says why the policy does not act",
    )
    counts = world.reconciler.counts
    seen = counts.reconciles
    wait_for(  # well past the rule's 1 s and the 1 s notice, judged again meanwhile
        lambda: counts.reconciles >= seen + 3 and datetime.now(UTC) - since > timedelta(seconds=4),
        what="more reconciles",
    )
    assert _announcement(world, "notebook") is None
    assert [e for e in events(world, "notebook") if e.startswith("GPUPolicy")] == []
    assert (_status(api, name).get("decisions") or []) == []
    meta: Any = pod(world, "notebook").metadata
    assert meta.deletion_timestamp is None, "not deleted"
    if "namespace_selector" in scope:  # in the selector, the same policy announces
        world.core.patch_namespace(world.ns, {"metadata": {"labels": {"gpuusage-test": "in"}}})
        wait_for(lambda: _announcement(world, "notebook"), timeout=30, what="announced")
        wait_for(lambda: "GPUPolicyPending" in events(world, "notebook"), what="the warning")


def _node_marks(api: client.ApiClient, node: str) -> tuple[str | None, list[str]]:
    found: Any = client.CoreV1Api(api).read_node(node)
    key = names.NODE_CONDITION_ORPHANED
    ours = [c.status for c in found.status.conditions or [] if c.type == key]
    return (ours[0] if ours else None), [t.effect for t in found.spec.taints or [] if t.key == key]


def test_orphaned_memory_is_recorded_in_a_dry_run_then_marks_the_node_when_enforced(
    make_world: WorldFactory, api: client.ApiClient, policy: PolicyMaker
) -> None:
    """Xorg (a host process) holds 2 GiB: the report's status says so; a DryRun node rule
    records what it would do and leaves the Node alone; made Enforce, the Node gets the
    condition and the taint (the kubelet's own taints kept); the memory freed, both go."""
    world = make_world({"train": 1}, operator_extras={"policy_actions": True})
    core = client.CoreV1Api(api)
    other = {"key": "example.com/maintenance", "value": "x", "effect": "NoSchedule"}
    core.patch_node(world.node, {"spec": {"taints": [other]}})
    held = [{"pid": 777, "usedMemoryMiB": 2048, "smUtil": 0}]
    world.scenario([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": held}])
    name = f"orphans-{world.ns}"
    rule = {"finding": "OrphanedGPUMemory", "after": "1s", "minMemoryMiB": 1024, "action": "Taint"}
    custom = client.CustomObjectsApi(api)
    policy(name, {"nodeRules": [rule]})

    def outcomes() -> list[str]:
        listed = _status(api, name).get("decisions") or []
        return [d["outcome"] for d in listed if d["target"]["name"] == world.node]

    wait_for(lambda: "DryRun" in outcomes(), timeout=60, what="the dry run recorded")

    def orphaned() -> Any:
        got: Any = custom.get_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, world.node
        )
        return got["status"].get("orphaned") or {}

    # the node rule acts on the judgement; the same reconcile may write the status after it
    wait_for(lambda: orphaned().get("memoryMiB") == 2048, what="the status says 2 GiB")
    assert _node_marks(api, world.node) == (None, [])
    custom.patch_cluster_custom_object(
        names.GROUP,
        names.VERSION,
        names.POLICY_PLURAL,
        name,
        {"spec": {"nodeRules": [{**rule, "mode": "Enforce"}]}},
    )
    wait_for(
        lambda: _node_marks(api, world.node) == ("True", ["NoSchedule"]),
        timeout=60,
        what="the condition and the taint",
    )
    found: Any = core.read_node(world.node)
    assert {other["key"], names.NODE_CONDITION_ORPHANED} <= {t.key for t in found.spec.taints}
    wait_for(lambda: "Done" in outcomes(), what="the decision")
    world.scenario([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []}])
    wait_for(
        lambda: _node_marks(api, world.node) == ("False", []),
        timeout=60,
        what="the marks taken off",
    )
    found = core.read_node(world.node)
    kept = {t.key for t in found.spec.taints}
    assert other["key"] in kept
    assert names.NODE_CONDITION_ORPHANED not in kept
    # The policy's status is written after the Node's marks: read it once it is there.
    wait_for(lambda: "Cleared" in outcomes(), what="the Cleared decision in the policy's status")


def test_kubectl_get_shows_a_policys_mode_and_rules_before_it_decides_anything(
    make_world: WorldFactory, api: client.ApiClient, kubectl: Kubectl, policy: PolicyMaker
) -> None:
    world = make_world({"train": 1})
    world.scenario(
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [{"pid": world.pids["train"], "usedMemoryMiB": 1024, "smUtil": 90}],
            }
        ]
    )
    name = f"quiet-{world.ns}"
    policy(
        name,
        {
            "namespaceSelector": in_namespace(world.ns),
            "rules": [
                {"finding": "HoldingIdleGPU", "action": "ScaleToZero", "mode": "Enforce"},
                {"finding": "UsingUnallocatedGPU", "action": "Evict", "mode": "Enforce"},
            ],
        },
    )
    wait_for(lambda: _status(api, name).get("observedGeneration") == 1, what="the status")
    lines = kubectl.run("get", "gpuusagepolicy", name).splitlines()
    assert lines[0].split() == ["NAME", "MODE", "RULES", "ACTIONS", "AGE"]
    assert lines[1].split()[:4] == [
        name,
        "Enforce",
        "HoldingIdleGPU>ScaleToZero,UsingUnallocatedGPU>Evict",
        "0",
    ]
    assert not _status(api, name).get("decisions")


def test_an_announcement_waits_for_the_budget_of_pod_writes_as_every_pod_write_does(
    make_world: WorldFactory, api: client.ApiClient, policy: PolicyMaker
) -> None:
    """Once the notebook is marked, the budget of pod writes is spent (refilled once in 1,000
    s): the policy's announcement then waits, counted as deferred, with no annotation, no
    Event and no decision."""
    world = make_world({"notebook": 0})
    assert world.built is not None
    marker, counts = world.built.reconciler.marker, world.built.reconciler.counts
    wait_for(
        lambda: condition(pod(world, "notebook")).reason == "UsingUnrequestedGPU",
        what="the notebook's finding",
    )
    spent = WriteBudget(rate=0.001, burst=2)
    assert spent.take(marker.monotonic(), 2)
    marker.write_budget = spent
    deferred = counts.writes_deferred
    name = f"misuse-{world.ns}"
    rule = {"finding": "UsingUnrequestedGPU", "after": "1h", "action": "Notify"}
    policy(name, {"namespaceSelector": in_namespace(world.ns), "rules": [rule]})
    wait_for(lambda: counts.writes_deferred >= deferred + 3, what="the announcement deferred")
    assert _announcement(world, "notebook") is None
    assert "GPUPolicyPending" not in events(world, "notebook")
    assert not _status(api, name).get("decisions")


def test_the_ledger_counts_on_the_status_the_apiserver_has(
    api: client.ApiClient, policy: PolicyMaker
) -> None:
    """The policies' ledger on the real status subresource: an action's count written before
    it is taken, its answer what the ledger builds on next; a merge patch naming an older
    resourceVersion refused (409), so a count built on a status another leader changed
    meanwhile never writes over it, and no action is taken on it: once the watch brings the
    change, it counts on top of it, up to the policy's limit."""
    custom = client.CustomObjectsApi(api)
    name = f"ledger-{uuid.uuid4().hex[:6]}"
    created = policy(
        name,
        {
            "namespaceSelector": {"matchLabels": {"gpuusage.io/test": name}},  # selects none
            "maxActionsPerHour": 3,
            "rules": [{"finding": "HoldingIdleGPU", "action": "DeletePod", "mode": "Enforce"}],
        },
    )
    state = PolicyState()
    state.apply("ADDED", created)
    now = datetime.now(UTC)
    book = PolicyLedger(policy_watch(state), custom, lambda: now, cluster_actions_per_hour=30)

    assert book.reserve(name) == Slot(at=now.replace(microsecond=0))
    assert _status(api, name)["actedAt"] == [format_time(now)]

    stale: Any = custom.get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, name
    )
    other = format_time(now - timedelta(seconds=30))
    custom.patch_cluster_custom_object_status(  # another leader, without a version
        names.GROUP,
        names.VERSION,
        names.POLICY_PLURAL,
        name,
        {"status": {"actedAt": [other, format_time(now)]}},
    )
    with pytest.raises(ApiException) as refused:
        custom.patch_cluster_custom_object_status(
            names.GROUP,
            names.VERSION,
            names.POLICY_PLURAL,
            name,
            {
                "metadata": {"resourceVersion": stale["metadata"]["resourceVersion"]},
                "status": {"actedAt": []},
            },
        )
    assert refused.value.status == 409

    # the ledger's write names the version its watch holds: refused, nothing taken
    assert book.reserve(name) == Slot(retry=now.replace(microsecond=0) + STATUS_RETRY)
    assert _status(api, name)["actedAt"] == [other, format_time(now)]
    brought: Any = custom.get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, name
    )
    state.apply("MODIFIED", brought)  # what the watch brings
    assert book.reserve(name) == Slot(at=now.replace(microsecond=0))
    assert _status(api, name)["actedAt"] == [other, format_time(now), format_time(now)]
    assert book.reserve(name).limited
