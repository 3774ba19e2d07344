"""Idle but holding on the real control plane: a notebook whose process keeps 70 GiB and
computes nothing is flagged (HoldingIdleGPU, a Warning Event, the status); a trainer computing
and a process on a MIG device (no per-process utilization: unknown, never idle) are not."""

from __future__ import annotations

import pytest

from tests.conftest import GPU0, GPU1, WorldFactory, wait_for
from tests.fakenvml import gpu_uuid, mig_uuid
from tests.simworld import SimWorld
from tests.worldview import condition, events, pod, refreshed_rarely, report

pytestmark = pytest.mark.cluster


def _reason(world: SimWorld, name: str) -> str:
    found = condition(pod(world, name))
    return f"{found.status} {found.reason}"


def _scenario(world: SimWorld, notebook_sm: int) -> None:
    pids = world.pids
    world.scenario(
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [{"pid": pids["train"], "usedMemoryMiB": 30720, "smUtil": 70}],
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
                "memoryTotalMiB": 40960,
                "migDevices": [
                    {
                        "index": 0,
                        "uuid": mig_uuid(0),
                        "memoryTotalMiB": 4864,
                        "processes": [{"pid": pids["slice"], "usedMemoryMiB": 2048, "smUtil": 0}],
                    }
                ],
            },
        ]
    )


def test_a_pod_holding_memory_and_computing_nothing_is_flagged(make_world: WorldFactory) -> None:
    world = make_world(
        {"train": 1, "notebook": 1, "slice": 1},
        idle_after=1.5,
        agent_extras={"idle_window": 0.5},
    )
    _scenario(world, notebook_sm=0)
    wait_for(lambda: _reason(world, "notebook") == "True HoldingIdleGPU", what="held idle")
    wait_for(lambda: "HoldingIdleGPU" in events(world, "notebook"), what="Warning Event")
    # the status is written after the pods in the same reconcile
    wait_for(lambda: report(world)["status"]["totals"]["heldIdlePods"] == 1, what="totals")
    entries = {p["name"]: p for p in report(world)["status"]["pods"]}
    assert entries["notebook"]["heldIdleSince"]
    assert entries["train"].get("heldIdleSince") is None
    assert entries["slice"].get("heldIdleSince") is None
    spec = report(world)["spec"]
    (notebook_process,) = spec["gpus"][1]["processes"]
    assert notebook_process["idleSince"]
    assert spec["gpus"][2]["migDevices"][0]["processes"][0].get("idleSince") is None
    # Several more reconciles: the trainer and the MIG process are never flagged.
    counts = world.reconciler.counts
    seen = counts.reconciles
    wait_for(lambda: counts.reconciles >= seen + 5, what="more reconciles")
    assert _reason(world, "train") == "True ProcessesRunning"
    assert _reason(world, "slice") == "True ProcessesRunning"

    _scenario(world, notebook_sm=12)  # the kernel runs a cell
    wait_for(lambda: _reason(world, "notebook") == "True ProcessesRunning", what="active again")
    wait_for(lambda: report(world)["status"]["totals"].get("heldIdlePods", 0) == 0, what="totals")


def test_idle_findings_come_on_time_while_the_report_does_not_change(
    make_world: WorldFactory,
) -> None:
    """With a Lease the agent rewrites an unchanged report only every few minutes, so no event
    comes when a pod's idle time reaches --idle-after: the operator looks again by itself.

    Until the report's status names the Lease, the agent rewrites the report every heartbeat
    (and the operator may judge the node before that): the report's generation is taken once
    the agent refreshes it only rarely, which --idle-after outlasts."""
    world = make_world(
        {"train": 1, "notebook": 1, "slice": 1, "waiter": 1},
        idle_after=20.0,
        agent_extras={"idle_window": 0.5},
        leases=True,
        agent_lease=True,
    )
    _scenario(world, notebook_sm=0)
    spec = wait_for(
        lambda: (s := report(world)["spec"])["gpus"][1]["processes"][0].get("idleSince") and s,
        what="the notebook's idleSince published",
    )
    generation = refreshed_rarely(world)
    assert spec["gpus"][1]["processes"][0]["idleSince"]
    assert _reason(world, "notebook") != "True HoldingIdleGPU", "not held idle yet"
    wait_for(lambda: _reason(world, "notebook") == "True HoldingIdleGPU", what="held idle")
    wait_for(lambda: _reason(world, "waiter") == "False RequestedGPUsIdle", what="waiter idle")
    assert report(world)["metadata"]["generation"] == generation, "no report write came between"
