"""The policies' ledger (policies.ledger): a policy's status falls behind on a fault, never
wrong, and its rate limits count each enforced action once, before it is taken.

The status lives in a dict here (builders.PolicyStatusApi: its faults and its resourceVersion
are the point), and the watch's events are handed to its state by each test (`echo`); that the
apiserver refuses a status write naming an older resourceVersion is proven in
test_policies_on_cluster, and the whole on it in test_policies_on_cluster and
test_operator_ha."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api.models import OrphanedMemory
from gpuusage.api.policy import MAX_DECISIONS, Decision, Target
from gpuusage_operator.index.pods import PodLookup
from gpuusage_operator.informers.policywatch import PolicyState
from gpuusage_operator.policies.act import Result
from gpuusage_operator.policies.ledger import GONE_RETRY, STATUS_RETRY, PolicyLedger, Slot
from gpuusage_operator.policies.noderule import NodeMarks
from gpuusage_operator.policies.noderun import NodeMemory, NodeRunner
from tests.builders import (
    Clock,
    PolicyStatusApi,
    ReportStatusApi,
    enforced_policy,
    fixed,
    listed_again,
    policy_runner,
    reconciler_on,
    run_housekeeping,
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


def echo(api: PolicyStatusApi, state: PolicyState) -> None:
    """The policy's watch brings its status as the apiserver has it now."""
    state.apply("MODIFIED", api.served(enforced_policy()))


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
    book, state, clock = ledger(api)
    decide(book, "first")
    book.flush()
    decide(book, "a")
    api.lose_answers = True
    book.flush()
    assert book.waiting()
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done"), ("first", "Done")], 2)
    api.lose_answers = False
    assert not flushed_when_due(book, clock), "not built on the version before it (409)"
    echo(api, state)
    assert flushed_when_due(book, clock)
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done"), ("first", "Done")], 2)
    assert api.writes == 3, "written again, the same"


def test_a_write_built_on_a_status_changed_meanwhile_waits_for_the_watch_to_bring_it() -> None:
    # another leader wrote while this one, without knowing, still takes itself for the leader
    api = PolicyStatusApi()
    book, state, clock = ledger(api)
    decide(book, "a")
    book.flush()
    other = {"target": {"kind": "Pod", "name": "x"}, "outcome": "Done", "done": True}
    api.write_elsewhere({"actionsTaken": 2, "decisions": [other, *api.status["decisions"]]})
    decide(book, "b")
    book.flush()
    assert book.waiting(), "refused (409): the decision waits"
    assert (listed(api), api.status["actionsTaken"]) == ([("x", "Done"), ("a", "Done")], 2)
    echo(api, state)
    assert flushed_when_due(book, clock)
    assert listed(api) == [("b", "Done"), ("x", "Done"), ("a", "Done")]
    assert api.status["actionsTaken"] == 3
    assert (api.attempts, api.writes) == (3, 2)


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


def test_a_mode_refused_for_good_is_not_tried_again_until_the_policy_changes() -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api)
    tried: list[int] = []
    refused = ApiException(status=403, reason="Forbidden")

    def refuse(*args: Any) -> Any:
        tried.append(1)
        raise refused

    api.patch_cluster_custom_object_status = refuse  # type: ignore[method-assign]
    book.flush()  # the new policy's mode and rules: refused for good
    for _ in range(3):
        clock.now += STATUS_RETRY
        book.flush()
    assert len(tried) == 1, "not tried again at every flush"
    state.apply("MODIFIED", api.served(edited_to_dry_run()))  # a new generation: tried once more
    clock.now += STATUS_RETRY
    book.flush()
    assert len(tried) == 2


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
    assert api.attempts == api.writes == 2, "each built on the answer of the one before it"


def test_an_edited_policy_shows_its_new_mode_once_though_no_decision_waits() -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api)
    decide(book, "a")
    book.flush()
    api.write_elsewhere({})  # the spec's edit: a new resourceVersion
    state.apply("MODIFIED", api.served(edited_to_dry_run()))
    api.refuse_writes = True
    book.flush()
    assert book.waiting(), "the edited policy's mode and rules wait"
    api.refuse_writes = False
    assert flushed_when_due(book, clock)
    assert (api.status["mode"], api.status["observedGeneration"]) == ("DryRun", 2)
    assert listed(api) == [("a", "Done")]
    attempts = api.attempts
    book.flush()
    assert api.attempts == attempts, "shown: the write's answer is what its watch holds"


def test_a_writes_answer_is_shown_only_over_the_version_it_was_built_on() -> None:
    """Where the watch's state shows another version, it brought this write or a later one
    already: the answer would take it back."""
    state = PolicyState()
    policy = enforced_policy()
    state.apply("ADDED", {**policy, "metadata": {**policy["metadata"], "resourceVersion": "10"}})
    answer = {"metadata": {"resourceVersion": "9"}, "status": {"actionsTaken": 1}}
    state.wrote("idle", "8", answer)
    assert (state.policies["idle"].version, state.policies["idle"].actions_taken) == ("10", 0)
    state.wrote("idle", "10", answer)
    assert (state.policies["idle"].version, state.policies["idle"].actions_taken) == ("9", 1)
    state.wrote("gone", "10", answer)
    assert state.ids() == {"idle"}


# -- rate limits ------------------------------------------------------------------------------


def test_an_action_is_counted_once_after_its_status_comes_back() -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api, limit=2)
    assert book.reserve("idle") == Slot(at=WHOLE)
    echo(api, state)
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


def test_no_action_is_taken_on_counts_while_the_policies_are_listed_again() -> None:
    """Nothing is decided on a state that a list under way replaces; nor on a count written
    as one began: the list may have been served before the count landed, and its state would
    not show it. Counted all the same: fewer actions, never more."""
    api = PolicyStatusApi()
    book, _, clock = ledger(api, limit=5)
    real_patch = api.patch_cluster_custom_object_status

    def broke_meanwhile(*args: Any) -> Any:
        book.watch.policies.synced.clear()  # its watch broke: listing again
        return real_patch(*args)

    api.patch_cluster_custom_object_status = broke_meanwhile  # type: ignore[method-assign]
    assert book.reserve("idle") == Slot(retry=WHOLE + STATUS_RETRY)
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z"]
    api.patch_cluster_custom_object_status = real_patch  # type: ignore[method-assign]
    assert book.reserve("idle") == Slot(retry=WHOLE + STATUS_RETRY)
    assert (book.acted(clock.now), api.attempts) == (None, 1), "not even tried"
    listed_again(book.watch, api.served(enforced_policy(limit=5)))
    assert book.reserve("idle") == Slot(at=WHOLE)
    assert len(api.status["actedAt"]) == 2


def test_an_action_not_taken_gives_its_slot_back() -> None:
    api = PolicyStatusApi()
    book, _, clock = ledger(api, limit=1)
    slot = book.reserve("idle")
    assert slot.at is not None
    book.release("idle", slot.at)  # refused by a PodDisruptionBudget, say
    assert api.status["actedAt"] == []
    decide(book, "a", "Refused")
    book.flush()
    clock.now += timedelta(minutes=1)
    assert book.reserve("idle").at is not None


def test_an_action_whose_policy_went_meanwhile_is_not_counted() -> None:
    api = PolicyStatusApi()
    book, state, _ = ledger(api, limit=1)
    state.apply("DELETED", enforced_policy())
    assert book.reserve("idle") == Slot(retry=WHOLE + GONE_RETRY)
    assert api.writes == 0


def test_a_count_built_on_a_status_another_leader_changed_is_decided_again() -> None:
    """Another leader counted an action that this replica's watch has not brought yet: the
    count built without it names an older version, is refused and not taken; decided again on
    what the watch brings, the other's action takes the last slot."""
    api = PolicyStatusApi()
    book, state, clock = ledger(api, limit=2)
    assert book.reserve("idle").at is not None
    clock.now += timedelta(minutes=1)
    api.write_elsewhere({"actedAt": [*api.status["actedAt"], "2026-11-27T12:01:00Z"]})
    assert book.reserve("idle") == Slot(retry=WHOLE + timedelta(minutes=1) + STATUS_RETRY)
    assert api.status["actedAt"] == ["2026-11-27T12:00:30Z", "2026-11-27T12:01:00Z"]
    echo(api, state)
    assert book.reserve("idle").limited, "the other leader's action counts"


@pytest.mark.parametrize("seen", ["watched", "listed"])
def test_the_cluster_wide_limit_counts_every_policy_and_one_gone_while_its_times_last(
    seen: str,
) -> None:
    api = PolicyStatusApi()
    book, state, clock = ledger(api, limit=5, cluster=2)
    state.apply("ADDED", api.served(enforced_policy("other", limit=5)))
    assert book.reserve("other").at is not None
    assert book.reserve("idle").at is not None
    clock.now += timedelta(seconds=1)
    assert book.reserve("idle").limited, "two of two, across the policies"
    api.statuses.pop("other")  # the policy deleted: its status with it
    if seen == "watched":
        state.apply("DELETED", enforced_policy("other"))
    else:  # while no watch was open: the list finds it gone
        listed_again(book.watch, api.served(enforced_policy(limit=5)))
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
    return (
        NodeRunner(runner, lambda *a: None, fixed(NodeMemory()), marker=cast(Any, marker)),
        marker,
        clock,
    )


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


def test_a_reconcile_flushes_its_decisions_and_a_new_leader_builds_on_its_watch() -> None:
    """The report's reconcile flushes the policies' decisions; a replica in a new term builds
    on what its watch brought of another leader's writes."""
    reconciler = reconciler_on(client.ApiClient(), reports_api=ReportStatusApi())
    api = PolicyStatusApi()
    runner, state = policy_runner(api, Clock(START))
    reconciler.policies = runner
    report = {
        "metadata": {"name": "gpu-node-a", "resourceVersion": "7", "generation": 1},
        "spec": example_spec("gpu-node-a", START).to_api(),
    }
    decide(runner.ledger, "a")
    reconciler.reconcile(report, PodLookup(), START)
    assert listed(api) == [("a", "Done")]
    api.write_elsewhere({"actionsTaken": 5})  # the other leader's, while this one stood by
    echo(api, state)
    reconciler.terms.begin()
    decide(runner.ledger, "b")
    reconciler.reconcile(report, PodLookup(), START)
    assert (listed(api), api.status["actionsTaken"]) == ([("b", "Done"), ("a", "Done")], 6)
    assert api.attempts == api.writes == 2, "no write refused"


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
    run_housekeeping(reconciler, monkeypatch, lambda: not runner.ledger.waiting())
    assert listed(api) == [("a", "Done")]
