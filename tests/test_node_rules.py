"""The OrphanedGPUMemory node rule, decided purely: which memory counts as orphaned and since
when, what the rule does about it, and how the Node's marks are read and rewritten without
touching what others put there."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpuusage.api import names
from gpuusage.api.models import OrphanedMemory, Process
from gpuusage.api.policy import NodeRule
from gpuusage_operator.judge.orphaned import orphaned_memory
from gpuusage_operator.judge.resolution import Resolution
from gpuusage_operator.policies.nodemarks import node_marks, taints_with
from gpuusage_operator.policies.noderule import NodeMarks, node_step

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
KEY = names.NODE_CONDITION_ORPHANED
TAINT = NodeRule(finding="OrphanedGPUMemory", after="10m", action="Taint", mode="Enforce")
NONE = NodeMarks()
MARKED = NodeMarks(condition=True, tainted=True)


def _held(pid: int, mib: int | None, reason: str | None, device: str = "GPU-a") -> Resolution:
    process = Process(pid=pid, used_memory_mib=mib)
    return Resolution(device, process, None, reason=reason)  # type: ignore[arg-type]


def test_only_memory_of_no_pod_is_orphaned_and_its_start_carries_on() -> None:
    resolutions = [
        _held(1, 2048, "PodNotFound"),
        _held(2, 1024, "UnknownContainer"),
        _held(3, 512, "HostProcess"),
        _held(3, 512, "HostProcess", device="GPU-b"),  # one process on two devices
        _held(4, 4096, "DriverProcess"),  # NVIDIA's MPS server holds it for its clients
        _held(5, 8192, "Unresolved"),  # not known to be of no pod
        _held(6, 9999, "PodOnOtherNode"),
        _held(7, None, "HostProcess"),  # memory unknown: counts as a process, not as memory
    ]
    found = orphaned_memory(resolutions, None, NOW + timedelta(microseconds=5))
    assert found == OrphanedMemory(memory_mib=4096, processes=5, since=NOW)
    later = orphaned_memory(resolutions[:1], found, NOW + timedelta(hours=1))
    assert later is not None
    assert (later.memory_mib, later.since) == (2048, NOW)
    assert orphaned_memory(resolutions[4:6], found, NOW) is None
    again = orphaned_memory(resolutions[:1], None, NOW + timedelta(hours=2))
    assert again is not None
    assert again.since == NOW + timedelta(hours=2)


def _orphaned(mib: int, minutes_ago: float) -> OrphanedMemory:
    return OrphanedMemory(memory_mib=mib, processes=1, since=NOW - timedelta(minutes=minutes_ago))


def test_an_enforced_rule_marks_after_its_duration_and_clears_when_freed() -> None:
    young, old = _orphaned(2048, 5), _orphaned(2048, 11)
    waiting = node_step(TAINT, young, NONE, certain=True, now=NOW)
    assert (waiting.kind, waiting.until) == ("Wait", NOW + timedelta(minutes=5))
    marking = node_step(TAINT, old, NONE, certain=True, now=NOW)
    assert (marking.kind, marking.wanted) == ("Mark", MARKED)
    assert node_step(TAINT, old, MARKED, certain=True, now=NOW).kind == "Nothing"
    notify = TAINT.model_copy(update={"action": "Notify"})
    assert node_step(notify, old, NONE, certain=True, now=NOW).wanted == NodeMarks(condition=True)
    below = _orphaned(512, 60)  # under minMemoryMiB (1024)
    for freed in (None, below):
        cleared = node_step(TAINT, freed, MARKED, certain=True, now=NOW)
        assert (cleared.kind, cleared.wanted) == ("Clear", NONE)
        assert node_step(TAINT, freed, NONE, certain=True, now=NOW).kind == "Nothing"


def test_uncertainty_changes_nothing_and_a_softened_rule_takes_its_taint_back() -> None:
    old = _orphaned(2048, 30)
    for marks in (NONE, MARKED):
        held = node_step(TAINT, None, marks, certain=False, now=NOW)
        assert (held.kind, held.wanted) == ("Nothing", marks)
    notify = TAINT.model_copy(update={"action": "Notify"})
    softened = node_step(notify, old, MARKED, certain=True, now=NOW)
    assert (softened.kind, softened.wanted) == ("Clear", NodeMarks(condition=True))
    dry = TAINT.model_copy(update={"mode": "DryRun"})
    assert node_step(dry, old, MARKED, certain=True, now=NOW).wanted == NONE
    recorded = node_step(dry, old, NONE, certain=True, now=NOW)
    assert (recorded.kind, recorded.wanted) == ("Record", NONE)
    assert node_step(None, old, MARKED, certain=True, now=NOW).kind == "Clear"


@pytest.mark.parametrize(
    ("conditions", "taints", "marks"),
    [
        ([], [], NONE),
        ([{"type": KEY, "status": "True"}], [], NodeMarks(condition=True)),
        (
            [{"type": KEY, "status": "False"}],
            [{"key": KEY, "effect": "NoSchedule"}],
            NodeMarks(tainted=True),
        ),
        ([{"type": "Ready", "status": "True"}], [{"key": "other", "effect": "NoSchedule"}], NONE),
    ],
)
def test_a_nodes_marks_are_read_from_its_condition_and_taint(
    conditions: list[dict[str, str]], taints: list[dict[str, str]], marks: NodeMarks
) -> None:
    assert node_marks({"status": {"conditions": conditions}, "spec": {"taints": taints}}) == marks


def test_our_taint_comes_and_goes_and_every_other_taint_stays() -> None:
    others = [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
    ]
    node = {"spec": {"taints": others}}
    tainted = taints_with(node, True)
    assert tainted == [*others, {"key": KEY, "value": "true", "effect": "NoSchedule"}]
    assert taints_with({"spec": {"taints": tainted}}, True) == tainted  # never twice
    assert taints_with({"spec": {"taints": tainted}}, False) == others
    assert taints_with({}, False) == []
