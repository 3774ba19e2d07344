"""The policies' ledger (policies.ledger): a policy's status falls behind on a fault, never
wrong, and its rate limits count each enforced action once, before it is taken.

The status lives in a dict here (builders.PolicyStatusApi: its faults and its resourceVersion
are the point); that the apiserver refuses a status write naming an older resourceVersion is
proven in test_policies_on_cluster, and the whole on it in test_policies_on_cluster and
test_operator_ha."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api.models import OrphanedMemory
from gpuusage.api.policy import MAX_DECISIONS, Decision, Target
from gpuusage_operator.controller import housekeeping as housekeeping_module
from gpuusage_operator.index.pods import PodLookup
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.policywatch import PolicyState
from gpuusage_operator.policies.act import Result
from gpuusage_operator.policies.ledger import GONE_RETRY, STATUS_RETRY, PolicyLedger, Slot
from gpuusage_operator.policies.noderule import NodeMarks
from gpuusage_operator.policies.noderun import NodeRunner
from tests.builders import (
    Clock,
    PolicyStatusApi,
    ReportStatusApi,
    enforced_policy,
    policy_runner,
    reconciler_on,
    tainting_runner,
)
from tests.examples import example_spec

START = datetime(2026, 11, 27, 12, 0, 30, 123456, tzinfo=UTC)
WHOLE = START.replace(microsecond=0)


def ledger(
    api: PolicyStatusApi, limit: int = 10, cluster: int = 30
) -> tuple[PolicyLedger, PolicyState, Clock]:
    clock = Clock(START)
    runner, state = policy_runner(api, clock, limit=limit, cluster=cluster)
    return runner.ledger, state, clock


def decide(book: PolicyLedger, pod: str, outcome: str = "Done") -> None:
    decision = Decision(
        target=Target(kind="Pod", namespace="ml", name=pod, uid=f"uid-{pod}"),
        finding="HoldingIdleGPU",
        action="Evict",
        mode="Enforce",
        decided_at=START,
        done=outcome == "Done",
        outcome=outcome,
    )
    book.add("idle", decision)


def edited_to_dry_run() -> dict[str, Any]:
    """The policy as listed once its owner turned its rule to DryRun (generation 2)."""
    edited = enforced_policy()
    edited["metadata"]["generation"] = 2
    edited["spec"]["rules"][0]["mode"] = "DryRun"
    return edited


def flushed_when_due(book: PolicyLedger, clock: Clock) -> bool:
    """A flush STATUS_RETRY later (a reconcile's or the housekeeping pass's) writes, and
    nothing waits after it."""
    clock.now += STATUS_RETRY
    book.flush()
    return not book.waiting()


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.001)


def listed(api: PolicyStatusApi) -> list[tuple[str, str]]:
    return [(d["target"]["name"], d["outcome"]) for d in api.status.get("decisions", [])]


# -- decisions --------------------------------------------------------------------------------


def test_decisions_whose_status_write_failed_are_written_by_a_later_flush() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api)
    decide(book, "a")
    api.refuse_writes = True
    book.flush()
    assert book.waiting(), "the decision waits"
    assert api.status == {}
    api.refuse_writes = False
    decide(book, "b", "Pending")
    attempts = api.attempts
    book.flush()
    assert api.attempts == attempts, "not tried again before STATUS_RETRY"
    assert flushed_when_due(book, clock)
    assert listed(api) == [("b", "Pending"), ("a", "Done")]
    assert api.status["actionsTaken"] == 1


def test_a_write_that_landed_though_its_answer_was_lost_is_not_counted_twice() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api)
    decide(book, "first")
    book.flush()
    decide(book, "a")
    api.lose_answers = True
    book.flush()
    assert book.waiting()
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done"), ("first", "Done")], 2)
    api.lose_answers = False
    assert flushed_when_due(book, clock)
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done"), ("first", "Done")], 2)
    assert api.writes == 3, "written again, the same"


def test_a_status_that_cannot_be_read_is_not_overwritten_with_less() -> None:
    api = PolicyStatusApi()
    earlier = {"target": {"kind": "Pod", "name": "old"}, "outcome": "Done", "done": True}
    api.write_elsewhere({"actionsTaken": 3, "decisions": [earlier]})
    book, _, clock = ledger(api)
    api.refuse_reads = True
    decide(book, "a")
    book.flush()
    assert book.waiting()
    assert api.attempts == 0, "not written without what it holds"
    api.refuse_reads = False
    assert flushed_when_due(book, clock)
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done"), ("old", "Done")], 4)


def written_a_then_another_leader_x() -> tuple[PolicyLedger, PolicyStatusApi]:
    """The ledger wrote decision a; then another leader recorded x (its action: 2 taken)."""
    api = PolicyStatusApi()
    book, _, _ = ledger(api)
    decide(book, "a")
    book.flush()
    other = {"target": {"kind": "Pod", "name": "x"}, "outcome": "Done", "done": True}
    api.write_elsewhere({"actionsTaken": 2, "decisions": [other, *api.status["decisions"]]})
    return book, api


def test_a_write_built_on_a_status_changed_meanwhile_is_read_back_and_made_again() -> None:
    # another leader wrote while this one, without knowing, still takes itself for the leader
    book, api = written_a_then_another_leader_x()
    decide(book, "b")
    book.flush()
    assert not book.waiting(), "refused (409), read back, written"
    assert listed(api) == [("b", "Done"), ("x", "Done"), ("a", "Done")]
    assert api.status["actionsTaken"] == 3
    assert (api.attempts, api.writes) == (3, 2)


def test_a_replica_that_leads_again_reads_back_what_another_wrote_meanwhile() -> None:
    book, api = written_a_then_another_leader_x()
    book.forget()  # turned active again
    decide(book, "b")
    book.flush()
    assert listed(api) == [("b", "Done"), ("x", "Done"), ("a", "Done")]
    assert api.status["actionsTaken"] == 3
    assert (api.attempts, api.writes) == (2, 2), "read back first: nothing refused"


def test_a_read_from_before_a_handover_is_not_kept_after_it() -> None:
    api = PolicyStatusApi()
    book, _, _ = ledger(api)
    real_get = api.get_cluster_custom_object_status

    def handover_meanwhile(*args: Any) -> Any:
        answer = real_get(*args)
        book.forget()  # between the answer and its keeping
        return answer

    api.get_cluster_custom_object_status = handover_meanwhile  # type: ignore[method-assign]
    assert book.acted(START) is None, "not used"
    api.get_cluster_custom_object_status = real_get  # type: ignore[method-assign]
    assert book.acted(START) == {"idle": []}


def test_a_status_refused_for_good_keeps_nothing_back() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api)
    real_patch = api.patch_cluster_custom_object_status
    refused = ApiException(status=403, reason="Forbidden")
    api.patch_cluster_custom_object_status = lambda *a: (_ for _ in ()).throw(refused)  # type: ignore[method-assign]
    decide(book, "a")
    book.flush()
    assert not book.waiting(), "dropped: it would never be written"
    api.patch_cluster_custom_object_status = real_patch  # type: ignore[method-assign]
    decide(book, "b")
    clock.now += STATUS_RETRY
    book.flush()
    assert listed(api) == [("b", "Done")]


def test_a_status_that_cannot_be_read_for_good_keeps_nothing_back() -> None:
    api = PolicyStatusApi()
    book, _, _ = ledger(api)
    gone = ApiException(status=404, reason="Not Found")
    api.get_cluster_custom_object_status = lambda *a: (_ for _ in ()).throw(gone)  # type: ignore[method-assign]
    decide(book, "a")
    book.flush()
    assert not book.waiting()
    assert api.attempts == 0


def test_while_they_wait_every_done_decision_is_kept_and_the_newest_others() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api)
    api.refuse_writes = True
    for n in range(MAX_DECISIONS + 20):
        decide(book, f"p{n}", "Done" if n % 10 == 0 else "Pending")
        clock.now += STATUS_RETRY
        book.flush()
    api.refuse_writes = False
    assert flushed_when_due(book, clock)
    done = (MAX_DECISIONS + 20) // 10
    assert api.status["actionsTaken"] == done, "every action taken is counted"
    names_ = [name for name, _ in listed(api)]
    assert len(names_) == MAX_DECISIONS
    assert names_[0] == f"p{MAX_DECISIONS + 19}", "the newest first"
    assert {f"p{n}" for n in range(0, MAX_DECISIONS + 20, 10)} <= set(names_)


def test_flushes_at_once_list_and_count_every_decision() -> None:
    gate = threading.Event()
    api = PolicyStatusApi(gate)
    book, _, _ = ledger(api)
    decide(book, "first")
    failed: list[BaseException] = []

    def flush() -> None:
        try:
            book.flush()
        except BaseException as exc:
            failed.append(exc)

    first = threading.Thread(target=flush)
    first.start()
    wait_until(lambda: api.held > 0)  # the first flush's write is under way
    decide(book, "second")
    book.flush()
    assert api.held == 1, "did not wait behind the write under way"
    gate.set()
    first.join(10)
    assert not first.is_alive()
    assert failed == []
    assert book.waiting(), "the second waits for the next flush"
    book.flush()
    assert not book.waiting()
    assert listed(api) == [("second", "Done"), ("first", "Done")]
    assert api.status["actionsTaken"] == 2


def test_a_status_whose_mode_alone_was_not_written_is_written_again() -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api)
    state.apply("MODIFIED", edited_to_dry_run())
    api.refuse_writes = True
    book.flush()
    assert book.waiting(), "the edited policy's mode and rules wait"
    api.refuse_writes = False
    assert flushed_when_due(book, clock)
    assert (api.status["mode"], api.status["observedGeneration"]) == ("DryRun", 2)


def test_an_edited_policy_shows_its_new_mode_though_its_version_changed() -> None:
    api = PolicyStatusApi()
    book, state, _ = ledger(api)
    decide(book, "a")
    book.flush()
    api.write_elsewhere({})  # the spec's edit: a new resourceVersion
    state.apply("MODIFIED", {**edited_to_dry_run(), "status": api.status})
    book.flush()
    assert not book.waiting()
    assert (api.status["mode"], api.status["observedGeneration"]) == ("DryRun", 2)
    assert listed(api) == [("a", "Done")]


# -- rate limits ------------------------------------------------------------------------------


def test_an_action_is_counted_once_after_its_status_comes_back() -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api, limit=2)
    assert book.reserve("idle") == Slot(at=WHOLE)
    state.apply("MODIFIED", {**enforced_policy(limit=2), "status": api.status})  # the echo
    clock.now = START + timedelta(minutes=1)
    assert book.acted(clock.now) == {"idle": [WHOLE]}
    assert book.reserve("idle") == Slot(at=WHOLE + timedelta(minutes=1)), "the second of two"
    clock.now += timedelta(seconds=1)
    assert book.reserve("idle").limited
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z", "2026-11-27T12:01:30Z"]


def test_an_action_is_counted_in_the_status_before_it_is_taken() -> None:
    api = PolicyStatusApi()
    first, _, _ = ledger(api, limit=1)
    assert first.reserve("idle") == Slot(at=WHOLE)
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z"]
    # the replica stops before it flushes a decision; the next leader reads the count
    second, _, clock = ledger(api, limit=1)
    clock.now += timedelta(seconds=20)
    assert second.reserve("idle") == Slot(retry=WHOLE + timedelta(hours=1), limited=True)


def test_an_action_whose_count_cannot_be_written_is_not_taken() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api, limit=1)
    api.refuse_writes = True
    assert book.reserve("idle") == Slot(retry=WHOLE + STATUS_RETRY)
    api.refuse_writes = False
    assert book.acted(clock.now) == {"idle": []}, "not counted"
    assert book.reserve("idle") == Slot(at=WHOLE)


def test_counts_that_cannot_be_read_take_no_action_and_write_no_count() -> None:
    api = PolicyStatusApi()
    api.write_elsewhere({"actedAt": ["2026-11-27T12:00:00Z"]})
    book, _, clock = ledger(api, limit=2)
    api.refuse_reads = True
    assert book.reserve("idle") == Slot(retry=WHOLE + STATUS_RETRY)
    assert book.acted(clock.now) is None
    assert api.status == {"actedAt": ["2026-11-27T12:00:00Z"]}
    api.refuse_reads = False
    assert book.reserve("idle") == Slot(at=WHOLE)
    assert api.status["actedAt"] == ["2026-11-27T12:00:00Z", "2026-11-27T12:00:30Z"]


def test_an_action_not_taken_gives_its_slot_back_and_the_next_status_drops_it() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api, limit=1)
    slot = book.reserve("idle")
    assert slot.at is not None
    book.release("idle", slot.at)  # refused by a PodDisruptionBudget, say
    decide(book, "a", "Refused")
    book.flush()
    assert api.status["actedAt"] == []
    clock.now += timedelta(minutes=1)
    assert book.reserve("idle").at is not None


def test_an_action_whose_policy_went_meanwhile_is_not_counted() -> None:
    api = PolicyStatusApi()
    book, state, _ = ledger(api, limit=1)
    state.apply("DELETED", enforced_policy())
    assert book.reserve("idle") == Slot(retry=WHOLE + GONE_RETRY)
    assert api.writes == 0


def test_a_count_built_on_a_status_another_leader_changed_is_decided_again() -> None:
    """The replica lost the lead and won it back within one reservation: the write it had
    built on what it knew before names an older version, is refused, and the count read back
    includes the other leader's action, which takes the last slot."""
    api = PolicyStatusApi()
    book, _, clock = ledger(api, limit=2)
    assert book.reserve("idle").at is not None
    clock.now += timedelta(minutes=1)
    real_patch = api.patch_cluster_custom_object_status

    def handover_meanwhile(*args: Any) -> Any:
        api.patch_cluster_custom_object_status = real_patch  # type: ignore[method-assign]
        api.write_elsewhere({"actedAt": [*api.status["actedAt"], "2026-11-27T12:01:00Z"]})
        book.forget()  # the write fence found this replica leading again
        return real_patch(*args)

    api.patch_cluster_custom_object_status = handover_meanwhile  # type: ignore[method-assign]
    assert book.reserve("idle").limited, "the other leader's action counts"
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z", "2026-11-27T12:01:00Z"]


def test_a_handover_noticed_while_counting_takes_no_action_on_counts_of_before() -> None:
    """The other policies' counts (the cluster-wide limit) were read in the term before: the
    count written stays (fewer actions, never more), the action waits and is decided again on
    counts read afresh."""
    api = PolicyStatusApi()
    book, state, clock = ledger(api, limit=5, cluster=2)
    state.apply("ADDED", enforced_policy("other", limit=5))
    assert book.reserve("idle").at is not None
    real_patch = api.patch_cluster_custom_object_status

    def handover_meanwhile(*args: Any) -> Any:
        api.patch_cluster_custom_object_status = real_patch  # type: ignore[method-assign]
        api.write_elsewhere({"actedAt": ["2026-11-27T12:00:10Z"]}, name="other")
        book.forget()
        return real_patch(*args)

    api.patch_cluster_custom_object_status = handover_meanwhile  # type: ignore[method-assign]
    clock.now += timedelta(seconds=1)
    assert book.reserve("idle") == Slot(retry=WHOLE + timedelta(seconds=1) + STATUS_RETRY)
    assert len(api.status["actedAt"]) == 2, "counted all the same"
    assert book.reserve("idle").limited, "three of two, on counts read afresh"


def test_the_cluster_wide_limit_counts_every_policy_and_one_gone_while_its_times_last() -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api, limit=5, cluster=2)
    state.apply("ADDED", enforced_policy("other", limit=5))
    assert book.reserve("other").at is not None
    assert book.reserve("idle").at is not None
    clock.now += timedelta(seconds=1)
    assert book.reserve("idle").limited, "two of two, across the policies"
    api.statuses.pop("other")  # the policy deleted: its status with it
    state.apply("DELETED", enforced_policy("other"))
    assert book.reserve("idle").limited, "its action of this hour still counts"
    clock.now += timedelta(hours=1)
    assert book.reserve("idle").at is not None
    assert set(book.acted(clock.now) or {}) == {"idle"}, "nothing kept of it once aged out"


def test_workers_acting_at_once_never_take_more_slots_than_the_limit() -> None:
    api = PolicyStatusApi()
    book, _, _ = ledger(api, limit=50, cluster=5)
    start = threading.Barrier(8)
    taken: list[Slot] = []

    def worker() -> None:
        start.wait()
        for _ in range(3):
            taken.append(book.reserve("idle"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(1 for s in taken if s.at is not None) == 5
    assert len(api.status["actedAt"]) == 5, "every slot taken is in the status"


# -- the node rule's taint --------------------------------------------------------------------


class Marker:
    """A Node's marks: read as none, written with the given outcome."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.written: list[NodeMarks] = []

    def read(self, node: str) -> NodeMarks:
        return NodeMarks()

    def write(self, node: str, wanted: NodeMarks, message: str, now: datetime) -> Result:
        self.written.append(wanted)
        return Result(cast(Any, self.outcome), "")


def tainting(api: PolicyStatusApi, outcome: str) -> tuple[NodeRunner, Marker, Clock]:
    clock = Clock(START)
    runner = tainting_runner(api, clock, limit=1)
    marker = Marker(outcome)
    return NodeRunner(runner, record=lambda *a: None, marker=cast(Any, marker)), marker, clock


def test_a_taint_is_counted_before_it_is_set_and_given_back_when_not_set() -> None:
    orphaned = OrphanedMemory(memoryMiB=4096, processes=1, since=START - timedelta(hours=1))
    api = PolicyStatusApi()
    refused, marker, clock = tainting(api, "Refused")
    refused.visit("n1", orphaned, certain=True, now=clock.now)
    assert marker.written == [NodeMarks(condition=True, tainted=True)]
    assert refused.runner.ledger.acted(clock.now) == {"idle": []}, "given back"

    api = PolicyStatusApi()
    done, marker, clock = tainting(api, "Done")
    done.visit("n1", orphaned, certain=True, now=clock.now)
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z"]
    assert done.runner.ledger.acted(clock.now) == {"idle": [WHOLE]}


# -- in the reconcile ---------------------------------------------------------------------------


def test_a_reconcile_flushes_its_decisions_and_a_new_leader_reads_back() -> None:
    """The report's reconcile flushes the policies' decisions; a replica that turns active
    reads each status back before writing it."""
    reconciler = reconciler_on(client.ApiClient(), reports_api=ReportStatusApi())
    api = PolicyStatusApi()
    runner, _ = policy_runner(api, Clock(START))
    reconciler.policies = runner
    report = {
        "metadata": {"name": "gpu-node-a", "resourceVersion": "7", "generation": 1},
        "spec": example_spec("gpu-node-a", START).to_api(),
    }
    decide(runner.ledger, "a")
    reconciler.reconcile(report, PodLookup(), START)
    assert listed(api) == [("a", "Done")]
    api.write_elsewhere({"actionsTaken": 5})  # the other leader's, while this one stood by
    reconciler.turned_active()
    decide(runner.ledger, "b")
    reconciler.reconcile(report, PodLookup(), START)
    assert (listed(api), api.status["actionsTaken"]) == ([("b", "Done"), ("a", "Done")], 6)
    assert api.attempts == api.writes == 2, "read back: no write refused"


def test_the_housekeeping_pass_writes_what_waits_though_no_reconcile_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decisions that could not be written wait for a flush; the housekeeping pass flushes
    them (the API probe answered, this replica leads), so none waits for a report to change.
    The probe is answered in-process: the pass itself runs on the apiserver in every
    on-cluster test."""
    reconciler = reconciler_on(client.ApiClient())
    api = PolicyStatusApi()
    clock = Clock(START)
    runner, _ = policy_runner(api, clock)
    reconciler.policies = runner
    decide(runner.ledger, "a")
    api.refuse_writes = True
    runner.ledger.flush()
    api.refuse_writes = False
    clock.now += STATUS_RETRY
    probe = SimpleNamespace(list_cluster_custom_object=lambda *a, **k: {"items": []})
    monkeypatch.setattr(client, "CustomObjectsApi", lambda api: probe)

    async def active() -> bool:
        return True

    async def run() -> None:
        lookup = SimpleNamespace(nodes_with_our_marks=set)
        task = asyncio.create_task(
            housekeeping_module.housekeeping(
                reconciler,
                cast(Any, SimpleNamespace(lookup=lambda: lookup)),
                0.01,
                cast(Any, SimpleNamespace(active=active)),
                health=ApiHealth(),
                known=set,
                ready=lambda: True,
            )
        )
        deadline = time.monotonic() + 10
        while runner.ledger.waiting() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(run())
    assert listed(api) == [("a", "Done")]
