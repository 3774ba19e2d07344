"""Liveness through a Lease on the real control plane: a steady node's report and status are
not rewritten while its agent renews its Lease; a dead agent's report still turns stale and its
pods Unknown; an agent that renews no Lease (an earlier version) is judged by its report."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import WorldFactory, wait_for
from tests.simworld import SimWorld
from tests.worldview import condition, pod, refusing, renewed_at, report

pytestmark = pytest.mark.cluster


def _stale(world: SimWorld) -> dict[str, Any]:
    conditions = report(world).get("status", {}).get("conditions") or []
    return next(c for c in conditions if c["type"] == "Stale")


def _leased(make_world: WorldFactory) -> SimWorld:
    """A world whose agent renews a Lease in the world's namespace (a 10 s Lease, renewed every
    third: about 3.3 s, at most a cycle late) and refreshes an unchanged report only after
    60 s; the operator watches that namespace, and calls a node stale after 6 s without a
    sign of life (more than a renewal's gap, less than three renewals)."""
    return make_world(leases=True, agent_lease=True, stale_after=6.0)


def _settled(world: SimWorld) -> dict[str, Any]:
    """The report once its agent refreshes it rarely: it learns that the operator judges the
    node by its Lease from the answer to a write, and until then refreshes every heartbeat
    (1 s here); so the report is settled once no write came for two heartbeats."""
    seen: list[tuple[str, float]] = []

    def quiet() -> dict[str, Any] | None:
        body = report(world)
        version = body["metadata"]["resourceVersion"]
        if not seen or seen[-1][0] != version:
            seen.append((version, time.monotonic()))
            return None
        return body if time.monotonic() - seen[-1][1] >= 2.5 else None

    settled: dict[str, Any] = wait_for(quiet, what="the report settled")
    return settled


def test_a_steady_node_writes_only_its_lease(make_world: WorldFactory) -> None:
    world = _leased(make_world)
    wait_for(lambda: _stale(world)["reason"] == "LeaseRenewed", what="fresh by the Lease")
    wait_for(lambda: condition(pod(world, "train")).reason == "ProcessesRunning", what="in use")
    before = _settled(world)
    last = renewed_at(world.api, world.node, world.ns)
    assert last is not None
    # Three renewals, together longer than the operator's stale_after (6 s): the report alone
    # would have gone stale; the Lease keeps it fresh, and nothing else is written.
    for _ in range(3):

        def later(previous: datetime = last) -> datetime | None:
            now = renewed_at(world.api, world.node, world.ns)
            return now if now is not None and now > previous else None

        last = wait_for(later, what="a renewal")
    after = report(world)
    assert after["metadata"]["generation"] == before["metadata"]["generation"], "no spec write"
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], (
        "no status write either"
    )
    assert _stale(world)["status"] == "False"
    assert condition(pod(world, "train")).status == "True"


def test_a_dead_agent_turns_the_report_stale_and_its_pods_unknown(
    make_world: WorldFactory,
) -> None:
    world = _leased(make_world)
    wait_for(lambda: _stale(world)["reason"] == "LeaseRenewed", what="fresh by the Lease")
    world.agent.halt()
    stale = wait_for(lambda: (c := _stale(world))["status"] == "True" and c, what="stale")
    assert stale["reason"] == "ReportOutdated"
    assert f"no renewal of Lease {world.ns}/{world.node}" in stale["message"]
    wait_for(lambda: condition(pod(world, "train")).status == "Unknown", what="pods Unknown")


def test_an_agent_without_a_lease_is_judged_by_its_report(make_world: WorldFactory) -> None:
    """The operator watches Leases; this agent (as one of the previous version) renews none and
    rewrites its report every second: fresh, and the condition says by what."""
    world = make_world(leases=True)
    fresh = wait_for(lambda: (c := _stale(world))["reason"] == "ReportFresh" and c, what="fresh")
    assert "renews no Lease" in fresh["message"]
    world.agent.halt()
    wait_for(lambda: _stale(world)["status"] == "True", what="stale once its rewrites stop")


def test_an_agent_with_a_lease_under_an_operator_that_ignores_it_stays_fresh(
    make_world: WorldFactory,
) -> None:
    """An upgrade that reaches the agents first: the operator (as one of the previous version)
    judges by the report's rewrites with a 4 s threshold, while the agent could refresh its
    report every 60 s. It does not, since the report's status never says LeaseRenewed: it keeps
    its 1 s heartbeat, and the node is never called stale."""
    world = make_world(leases=False, agent_lease=True)
    fresh = wait_for(lambda: (c := _stale(world))["reason"] == "ReportFresh" and c, what="fresh")
    generation = report(world)["metadata"]["generation"]
    # Six refreshes, a second apart: longer than the operator's threshold (4 s).
    wait_for(
        lambda: report(world)["metadata"]["generation"] >= generation + 6,
        what="refreshes every second",
    )
    assert _stale(world)["status"] == "False"
    assert _stale(world)["lastTransitionTime"] == fresh["lastTransitionTime"], "never stale"
    assert condition(pod(world, "train")).status == "True"


def test_a_report_the_apiserver_refuses_is_not_kept_fresh_by_the_lease(
    make_world: WorldFactory,
) -> None:
    """An admission policy refuses every write of this node's report (as a webhook or a new
    schema may): the agent stops renewing its Lease, since the Lease vouches for a published
    report, so the node turns stale and its pods Unknown instead of showing content of any
    age as current. Once writes are admitted again, the node is fresh."""
    world = _leased(make_world)
    wait_for(lambda: _stale(world)["reason"] == "LeaseRenewed", what="fresh by the Lease")
    wait_for(lambda: condition(pod(world, "train")).status == "True", what="train in use")
    custom = client.CustomObjectsApi(world.api)

    def in_force() -> bool:
        try:
            custom.patch_cluster_custom_object(
                "gpuusage.io", "v1alpha1", "gpunodeusages", world.node, {"spec": {}}
            )
        except client.ApiException as exc:
            return exc.status == 422 and "refused by a test policy" in str(exc.body)
        return False

    name = f"refuse-{world.node}"
    with refusing(world.api, name, world.node, "gpunodeusages", ["CREATE", "UPDATE"]):
        wait_for(in_force, what="the policy in force")  # policies are compiled asynchronously
        world.write(notebook=False)  # a change the agent must publish, and cannot
        stale = wait_for(lambda: (c := _stale(world))["status"] == "True" and c, what="stale")
        assert f"no renewal of Lease {world.ns}/{world.node}" in stale["message"]
        wait_for(lambda: condition(pod(world, "train")).status == "Unknown", what="pods Unknown")
    wait_for(lambda: _stale(world)["status"] == "False", what="fresh once admitted")
    world.write(notebook=True)  # the next change is published whole
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="the change shown")


def test_unless_told_otherwise_a_node_is_stale_after_its_leases_own_duration(
    make_world: WorldFactory,
) -> None:
    """No --stale-after: the agent's 10 s Lease says how long it vouches for itself, and the
    operator holds it to that, as the node lifecycle controller holds a kubelet."""
    world = make_world(leases=True, agent_lease=True, stale_after=None)
    fresh = wait_for(
        lambda: (s := _stale(world))["reason"] == "LeaseRenewed" and s, what="fresh by the Lease"
    )
    assert "within the 10s threshold" in fresh["message"]
    world.agent.halt()
    stale = wait_for(lambda: (s := _stale(world))["status"] == "True" and s, what="stale")
    assert stale["reason"] == "ReportOutdated"
    assert "(threshold 10s)" in stale["message"]
    wait_for(lambda: condition(pod(world, "train")).status == "Unknown", what="train Unknown")
