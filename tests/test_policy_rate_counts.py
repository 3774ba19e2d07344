"""The policies' rate limits count each enforced action once, in this replica and in the policy's
status before it is taken: once its status comes back it is not counted a second time (the
status holds whole seconds), a replica that stops right after acting leaves the next leader its
count, an action not taken gives its slot back, and workers acting at once never both take the
last slot. The status lives in a dict here (builders.PolicyStatusApi: its faults are the
point); what the apiserver keeps is proven in test_policies_on_cluster and test_operator_ha."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

from gpuusage_operator.informers.policies import PolicyState
from gpuusage_operator.policies.run import STATUS_RETRY, PolicyRunner, Slot
from tests.builders import PolicyStatusApi, enforced_policy, policy_runner

NOW = datetime(2026, 11, 27, 12, 0, 30, 123456, tzinfo=UTC)


def replica(
    api: PolicyStatusApi, limit: int, cluster: int = 30
) -> tuple[PolicyRunner, PolicyState]:
    return policy_runner(api, NOW, limit=limit, cluster=cluster)


def test_an_action_is_counted_once_after_its_status_comes_back() -> None:
    api = PolicyStatusApi()
    runner, state = replica(api, limit=2)
    assert runner.reserve("idle", NOW) == Slot()
    state.apply(
        "MODIFIED", {**enforced_policy(limit=2), "status": api.status}
    )  # the echo, whole seconds
    later = NOW + timedelta(minutes=1)
    assert runner.acted(later) == {"idle": [NOW]}
    assert runner.reserve("idle", later) == Slot(), "the second of two allowed"
    assert runner.reserve("idle", later + timedelta(seconds=1)).limited
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z", "2026-11-27T12:01:30Z"]


def test_an_action_is_counted_in_the_status_before_it_is_taken() -> None:
    api = PolicyStatusApi()
    first, _ = replica(api, limit=1)
    assert first.reserve("idle", NOW) == Slot()
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z"]
    # the replica stops before it writes any decision; the next leader reads the count
    second, _ = replica(api, limit=1)
    slot = second.reserve("idle", NOW + timedelta(seconds=20))
    assert slot.limited
    assert slot.retry == NOW.replace(microsecond=0) + timedelta(hours=1)


def test_an_action_whose_count_cannot_be_written_is_not_taken() -> None:
    api = PolicyStatusApi()
    runner, _ = replica(api, limit=1)
    api.refuse_writes = True
    assert runner.reserve("idle", NOW) == Slot(NOW + STATUS_RETRY)
    api.refuse_writes = False
    assert runner.acted(NOW) == {"idle": []}, "given back"
    assert runner.reserve("idle", NOW + STATUS_RETRY) == Slot()


def test_counts_that_cannot_be_read_take_no_action_and_write_no_count() -> None:
    api = PolicyStatusApi()
    api.status = {"actedAt": ["2026-11-27T12:00:00Z"]}
    runner, _ = replica(api, limit=2)
    api.refuse_reads = True
    assert runner.reserve("idle", NOW) == Slot(NOW + STATUS_RETRY)
    assert runner.acted(NOW) is None
    assert api.status == {"actedAt": ["2026-11-27T12:00:00Z"]}
    api.refuse_reads = False
    assert runner.reserve("idle", NOW) == Slot()
    assert api.status["actedAt"] == ["2026-11-27T12:00:00Z", "2026-11-27T12:00:30Z"]


def test_an_action_not_taken_gives_its_slot_back_and_the_next_status_drops_it() -> None:
    api = PolicyStatusApi()
    runner, _ = replica(api, limit=1)
    assert runner.reserve("idle", NOW) == Slot()
    runner.release("idle", NOW)  # refused by a PodDisruptionBudget, say
    runner.record_decision(
        "idle",
        cast(Any, {"kind": "Pod", "name": "a"}),
        SimpleNamespace(finding="HoldingIdleGPU", action="Evict", mode="Enforce", due=NOW),
        "Refused",
        NOW,
    )
    runner.flush()
    assert api.status["actedAt"] == []
    assert runner.reserve("idle", NOW + timedelta(minutes=1)) == Slot()


def test_a_replica_that_leads_again_counts_what_the_status_holds() -> None:
    api = PolicyStatusApi()
    runner, _ = replica(api, limit=3)
    assert runner.reserve("idle", NOW) == Slot()
    other = "2026-11-27T12:01:00Z"  # another replica's, while this one stood by
    api.status = {"actedAt": [*api.status["actedAt"], other]}
    runner.forget_written()
    counted = runner.acted(NOW + timedelta(minutes=2)) or {}
    assert [t.isoformat() for t in counted["idle"]] == [
        "2026-11-27T12:00:30+00:00",
        "2026-11-27T12:01:00+00:00",
    ]


def test_workers_acting_at_once_never_take_more_slots_than_the_limit() -> None:
    api = PolicyStatusApi()
    runner, _ = replica(api, limit=50, cluster=7)
    start = threading.Barrier(16)
    taken: list[Slot] = []

    def worker(i: int) -> None:
        start.wait()
        for j in range(4):
            slot = runner.reserve("idle", NOW + timedelta(microseconds=i * 10 + j))
            taken.append(slot)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(1 for s in taken if s.retry is None) == 7
    assert len(api.status["actedAt"]) == 7, "every slot taken is in the status"
