"""Idle but holding, operator side: when a pod is flagged, by whose clock, and what it shows."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from gpuusage.api.models import Process
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.allocation import Allocation, Judgement
from gpuusage_operator.judge.findings import REASON_HELD_IDLE, REASON_UNREQUESTED
from gpuusage_operator.judge.holding import held_idle, held_idle_since, next_held_deadline
from gpuusage_operator.judge.podstate import desired_condition
from gpuusage_operator.judge.resolution import PodUse, Resolution
from gpuusage_operator.judge.status import pod_usages
from gpuusage_operator.writers.marks import event_for
from tests.fakenvml import gpu_uuid

T = datetime(2026, 11, 24, 9, 0, 0, tzinfo=UTC)
POD = PodSnapshot("ml", "notebook", "11111111-2222-4333-8444-555555555555", "n1", gpu_requests=1)
AFTER = timedelta(minutes=30)
ALLOCATED = Judgement(Allocation(("DevicePlugin",)))


def _use(observed_at: datetime, *idle_since: datetime | None, mib: int | None = 1024) -> PodUse:
    resolutions = tuple(
        Resolution(
            gpu_uuid(n % 2), Process(pid=100 + n, idle_since=since, used_memory_mib=mib), POD
        )
        for n, since in enumerate(idle_since)
    )
    return PodUse(POD, "n1", observed_at, resolutions)


@pytest.mark.parametrize("skew", [timedelta(0), timedelta(hours=1), -timedelta(hours=3)])
def test_the_nodes_clock_cannot_hasten_or_delay_the_finding(skew: timedelta) -> None:
    """The node says its processes went idle 20 minutes before its report; the operator saw
    the report at T. Whatever the node's clock is off by, the pod is idle since T - 20 min."""
    node_now = T + skew
    use = _use(node_now, node_now - timedelta(minutes=20), node_now - timedelta(minutes=25))
    assert held_idle_since(use, seen_at=T) == T - timedelta(minutes=20)
    assert held_idle([use], T, T + timedelta(minutes=9), AFTER) == {}
    assert held_idle([use], T, T + timedelta(minutes=10), AFTER) == {
        POD.uid: T - timedelta(minutes=20)
    }
    assert held_idle([use], T, T + timedelta(days=1), None) == {}, "--idle-after 0: off"


def test_one_process_computing_or_unknown_keeps_the_pod_from_being_flagged() -> None:
    long_ago = T - timedelta(days=1)
    assert held_idle_since(_use(T, long_ago, None), seen_at=T) is None
    assert held_idle_since(_use(T), seen_at=T) is None


def test_holding_needs_memory_held() -> None:
    """Idle processes that hold 0 MiB, or memory NVML does not tell, keep nothing from
    anyone: not holding."""
    long_ago = T - timedelta(days=1)
    assert held_idle_since(_use(T, long_ago, mib=1024), seen_at=T) == long_ago
    assert held_idle_since(_use(T, long_ago, long_ago, mib=0), seen_at=T) is None
    assert held_idle_since(_use(T, long_ago, mib=None), seen_at=T) is None


def test_the_condition_says_holding_idle_after_the_allocation_findings() -> None:
    use = _use(T, T - timedelta(hours=2))
    held = replace(ALLOCATED, held_idle_since=T - timedelta(hours=2))
    condition = desired_condition("InUse", use, "n1", judgement=held)
    assert (condition["status"], condition["reason"]) == ("True", REASON_HELD_IDLE)
    assert "computed anything" in condition["message"]
    assert "--idle-after" in condition["message"]
    later = replace(held, held_idle_since=T - timedelta(hours=2, seconds=1))
    assert desired_condition("InUse", use, "n1", judgement=later) == condition, (
        "the condition does not move with the time (no pod write per report)"
    )
    rogue = replace(held, allocation=Allocation(), finding="Unrequested")
    assert desired_condition("InUse", use, "n1", judgement=rogue)["reason"] == REASON_UNREQUESTED
    running = desired_condition("InUse", use, "n1", judgement=ALLOCATED)
    started = event_for(running, condition)
    assert started is not None
    assert (started.reason, started.type) == (REASON_HELD_IDLE, "Warning")
    assert event_for(condition, condition) is None
    assert event_for(condition, running) is None, "computing again: no Event"


def test_the_status_marks_each_entry_of_a_held_idle_pod() -> None:
    use = _use(T, T - timedelta(hours=2), T - timedelta(hours=3))
    since = T - timedelta(hours=2)
    entries = pod_usages([use], {POD.uid: replace(ALLOCATED, held_idle_since=since)})
    assert [(e.device_uuid, e.held_idle_since) for e in entries] == [
        (gpu_uuid(0), since),
        (gpu_uuid(1), since),
    ]


def test_the_next_deadline_is_when_the_idle_processes_reach_idle_after() -> None:
    use = _use(T, T - timedelta(minutes=20))
    computing = _use(T, None)
    due = next_held_deadline([use, computing], T, T, AFTER)
    assert due == T + timedelta(minutes=10)
    assert held_idle([use], T, due - timedelta(seconds=1), AFTER) == {}
    assert POD.uid in held_idle([use], T, due, AFTER)
    assert next_held_deadline([use], T, due, AFTER) is None, "flagged by then: nothing to wait"
    assert next_held_deadline([use], T, T, None) is None


def test_computing_is_told_per_device_and_never_guessed() -> None:
    """The bill's GPU-hours computing: a device where one of the pod's processes works is
    computing, one where all are quiet for the agent's window is not, and one whose device
    tells nothing of activity (MIG, MPS clients) is neither."""
    quiet = T - timedelta(minutes=10)
    told = [
        Resolution(gpu_uuid(0), Process(pid=1, idle_since=quiet, used_memory_mib=10), POD),
        Resolution(gpu_uuid(0), Process(pid=2, used_memory_mib=10), POD),
        Resolution(gpu_uuid(1), Process(pid=3, idle_since=quiet, used_memory_mib=10), POD),
        Resolution(gpu_uuid(1), Process(pid=4, activity_unknown=True, used_memory_mib=10), POD),
        Resolution(gpu_uuid(2), Process(pid=5, activity_unknown=True, used_memory_mib=10), POD),
    ]
    usages = pod_usages([PodUse(POD, "n1", T, tuple(told))], {POD.uid: ALLOCATED})
    assert {u.device_uuid: u.computing for u in usages} == {
        gpu_uuid(0): True,
        gpu_uuid(1): False,
        gpu_uuid(2): None,
    }
    # as the status's list is written: defaults left out
    written = [u.model_dump(mode="json", by_alias=True, exclude_defaults=True) for u in usages]
    assert [w.get("computing") for w in written] == [True, False, None]
    assert "computing" not in written[2], "unknown is left out, not written as false"
