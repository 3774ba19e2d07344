"""A policy's status that cannot be written or read loses no decision and counts none twice:
the decisions wait for the next flush, and the status is read back before it (a write whose
answer was lost may have landed; another replica may have written while this one stood by).
The status as the apiserver keeps it is proven in test_policies_on_cluster; here the API's
faults are the point, so the status lives in a dict (builders.PolicyStatusApi)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

from gpuusage.api.policy import Target
from gpuusage_operator.policies.run import PolicyRunner
from tests.builders import PolicyStatusApi, policy_runner

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def runner() -> tuple[PolicyRunner, PolicyStatusApi]:
    api = PolicyStatusApi()
    policies, _ = policy_runner(api, NOW)
    return policies, api


def decide(policies: PolicyRunner, pod: str, at: datetime, outcome: str = "Done") -> None:
    subject = SimpleNamespace(finding="HoldingIdleGPU", action="Evict", mode="Enforce", due=at)
    target = Target(kind="Pod", namespace="ml", name=pod, uid=f"uid-{pod}")
    policies.record_decision("idle", target, subject, cast(Any, outcome), at)


def listed(api: PolicyStatusApi) -> list[tuple[str, str]]:
    return [(d["target"]["name"], d["outcome"]) for d in api.status.get("decisions", [])]


def test_decisions_whose_status_write_failed_are_written_by_the_next_flush() -> None:
    policies, api = runner()
    decide(policies, "a", NOW)
    api.refuse_writes = True
    assert policies.flush() is True, "the decision waits"
    assert api.status == {}
    api.refuse_writes = False
    decide(policies, "b", NOW + timedelta(seconds=1), "Pending")
    assert policies.flush() is False
    assert listed(api) == [("b", "Pending"), ("a", "Done")]
    assert api.status["actionsTaken"] == 1


def test_a_write_that_landed_though_its_answer_was_lost_is_not_counted_twice() -> None:
    policies, api = runner()
    decide(policies, "a", NOW)
    api.lose_answers = True
    assert policies.flush() is True
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done")], 1)
    api.lose_answers = False
    assert policies.flush() is False
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done")], 1)
    assert api.writes == 2, "written again, the same"


def test_a_status_that_cannot_be_read_is_not_overwritten_with_less() -> None:
    policies, api = runner()
    earlier = {"target": {"kind": "Pod", "name": "old"}, "outcome": "Done", "done": True}
    api.status = {"actionsTaken": 3, "decisions": [earlier]}
    api.refuse_reads = True
    decide(policies, "a", NOW)
    assert policies.flush() is True
    assert api.writes == 0, "not written without what it holds"
    api.refuse_reads = False
    assert policies.flush() is False
    assert (listed(api), api.status["actionsTaken"]) == ([("a", "Done"), ("old", "Done")], 4)


def test_a_replica_that_acts_again_reads_back_what_another_wrote_meanwhile() -> None:
    policies, api = runner()
    decide(policies, "a", NOW)
    policies.flush()
    other = {"target": {"kind": "Pod", "name": "x"}, "outcome": "Done", "done": True}
    api.status = {**api.status, "actionsTaken": 2, "decisions": [other, *api.status["decisions"]]}
    policies.forget_written()  # turned active again
    decide(policies, "b", NOW + timedelta(minutes=1))
    policies.flush()
    assert listed(api) == [("b", "Done"), ("x", "Done"), ("a", "Done")]
    assert api.status["actionsTaken"] == 3
