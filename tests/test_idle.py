"""Idle detection of requested GPUs, the pure rules (on the cluster: test_operator_on_cluster)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuusage.api.models import DeviceError, GpuNodeUsageSpec, Source
from gpuusage.api.times import format_time
from gpuusage_operator.index.dra import NO_DRA
from gpuusage_operator.index.pods import REQUESTING_KEY, PodSnapshot, snapshot_of
from gpuusage_operator.judge.allocation import AllocatedDevice, Allocation, allocation_of
from gpuusage_operator.judge.certainty import blind_spots
from gpuusage_operator.judge.idle import idle_pods, idle_since, next_idle_deadline
from gpuusage_operator.judge.podstate import desired_condition
from gpuusage_operator.judge.requests import DEFAULT_RULES
from gpuusage_operator.writers.marks import condition_patch
from tests.builders import index_keys
from tests.examples import example_spec

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
STARTED = NOW - timedelta(hours=2)
HOUR = timedelta(hours=1)
GPU = "GPU-00000000-1111-2222-3333-444444444444"


def body(
    *,
    gpus: int = 2,
    phase: str = "Running",
    condition: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "w", "namespace": "ml", "uid": "u-1", "resourceVersion": "9"}
    if deleting:
        meta["deletionTimestamp"] = format_time(NOW)
    return {
        "metadata": meta,
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        },
        "status": {
            "phase": phase,
            "startTime": format_time(STARTED),
            "conditions": [condition] if condition else [],
        },
    }


def by_request(pod: PodSnapshot) -> Allocation:
    """What the pod was handed by its requests alone (no claims, no kubelet: the report's
    rule with nothing else known)."""
    return allocation_of(pod.claimed, NO_DRA, DEFAULT_RULES)


def ref(**kwargs: Any) -> PodSnapshot:
    found = snapshot_of(body(**kwargs))
    assert found is not None
    return found


def cond(status: str, reason: str, when: datetime) -> dict[str, str]:
    return {
        "type": "gpuusage.io/GPUInUse",
        "status": status,
        "reason": reason,
        "lastTransitionTime": format_time(when),
        "message": "",
    }


def test_only_running_pods_that_may_hold_gpus_are_indexed_as_candidates() -> None:
    assert REQUESTING_KEY + "n1" in index_keys(body())
    assert REQUESTING_KEY + "n1" not in index_keys(body(gpus=0))
    claimed = body(gpus=0)
    claimed["spec"]["resourceClaims"] = [{"name": "g", "resourceClaimName": "gpu-claim"}]
    assert REQUESTING_KEY + "n1" in index_keys(claimed)
    shared = body(gpus=0)
    shared["metadata"]["annotations"] = {"gpu-fraction": "0.5"}
    assert REQUESTING_KEY + "n1" in index_keys(shared)
    assert REQUESTING_KEY + "n1" not in index_keys(body(phase="Pending"))
    assert REQUESTING_KEY + "n1" not in index_keys(body(phase="Succeeded"))
    assert REQUESTING_KEY + "n1" not in index_keys(body(deleting=True))


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        (None, STARTED),  # never used: since the pod started
        (cond("False", "ProcessesEnded", NOW - HOUR), NOW - HOUR),  # since its use ended
        (cond("False", "RequestedGPUsIdle", STARTED), STARTED),  # a flagged pod stays flagged
        (cond("True", "ProcessesRunning", NOW - HOUR), NOW),  # in use until this report
        (cond("Unknown", "NodeReportStale", NOW - HOUR), NOW),  # nothing known meanwhile
    ],
)
def test_idle_since(condition: dict[str, str] | None, expected: datetime) -> None:
    assert idle_since(ref(condition=condition), NOW) == expected


def test_not_candidates() -> None:
    assert (
        idle_pods([ref(gpus=0)], in_use=set(), now=NOW, idle_after=HOUR, allocated=by_request) == []
    )
    assert idle_since(ref(phase="Pending"), NOW) is None


def test_claims_and_shares_are_judged_by_what_they_got() -> None:
    """A pod whose only claim got a GPU is idle like one that requested it; a claim of another
    kind of device, or one that cannot be read, makes no candidate."""
    pod = replace(ref(gpus=0), uid="11111111-2222-4333-8444-555555555555")
    gpu_claim = Allocation(("DRA",), (AllocatedDevice("claim c", GPU),), True, "", "claim c")
    (found,) = idle_pods([pod], set(), NOW, HOUR, allocated=lambda _: gpu_claim)
    assert found.entry().requested_gpus == 1
    wanted = desired_condition("Idle", None, "n1", found)
    assert "was given claim c but none of its processes" in wanted["message"]
    for nothing in (Allocation(), Allocation(unknown="claim c: not found or not allocated")):

        def given(_: PodSnapshot, n: Allocation = nothing) -> Allocation:
            return n

        assert idle_pods([pod], set(), NOW, HOUR, allocated=given) == []
    shared = Allocation(("Fractional",), detail="a share (gpu-fraction=0.5)")
    (share,) = idle_pods([pod], set(), NOW, HOUR, allocated=lambda _: shared)
    assert share.entry().requested_gpus == 0


def test_threshold_in_use_and_switch_off() -> None:
    waiting, ended = ref(), ref(condition=cond("False", "ProcessesEnded", NOW - HOUR / 2))
    found = idle_pods(
        [waiting, ended], in_use=set(), now=NOW, idle_after=HOUR, allocated=by_request
    )
    assert [(i.pod.uid, i.since) for i in found] == [("u-1", STARTED)], "30 min < 1 h"
    assert (
        idle_pods([waiting], in_use={"u-1"}, now=NOW, idle_after=HOUR, allocated=by_request) == []
    )
    assert idle_pods([waiting], in_use=set(), now=NOW, idle_after=None, allocated=by_request) == []
    assert (
        len(idle_pods([ended], in_use=set(), now=NOW, idle_after=HOUR / 2, allocated=by_request))
        == 1
    ), "boundary"


def test_incomplete_reports_judge_nobody() -> None:
    """Idle is judged only on a report blind nowhere (the reconciler asks blind_spots)."""
    spec = example_spec("n1", NOW)
    assert not blind_spots(spec, [])
    broken = spec.gpus[0].model_copy(
        update={"error": DeviceError(reason="GpuIsLost", message="fell off the bus")}
    )
    assert blind_spots(spec.model_copy(update={"gpus": [broken, *spec.gpus[1:]]}), [])
    blind = GpuNodeUsageSpec(
        node_name="n1", observed_at=NOW, source=Source(kind="none", available=False)
    )
    assert blind_spots(blind, [])


def test_flagging_is_stable_once_written() -> None:
    """The condition written for an idle pod reads back as the same idleness: no flip-flop."""
    waiting = ref()
    (first,) = idle_pods([waiting], in_use=set(), now=NOW, idle_after=HOUR, allocated=by_request)
    wanted = desired_condition("Idle", None, "n1", first)
    assert (wanted["status"], wanted["reason"]) == ("False", "RequestedGPUsIdle")
    assert "given 2 GPUs (device plugin)" in wanted["message"]
    assert format_time(STARTED) in wanted["message"]
    written = condition_patch([], wanted, first.since)
    assert written is not None
    later = NOW + timedelta(minutes=5)
    (again,) = idle_pods(
        [ref(condition=written)], in_use=set(), now=later, idle_after=HOUR, allocated=by_request
    )
    assert again.since == first.since
    assert condition_patch([written], desired_condition("Idle", None, "n1", again), later) is None


def test_the_next_deadline_is_when_the_next_pod_would_turn_idle() -> None:
    """A report that does not change sends no event: the operator looks again at this time,
    and then idle_pods finds the pod (the two agree on the boundary)."""
    ended = ref(condition=cond("False", "ProcessesEnded", NOW - HOUR / 2))
    waiting = ref()  # started two hours ago: already idle for an hour's threshold
    due = next_idle_deadline([ended, waiting], in_use=set(), now=NOW, idle_after=HOUR)
    assert due == NOW + HOUR / 2, "the already idle pod needs no wake-up"
    assert (
        idle_pods(
            [ended],
            in_use=set(),
            now=due - timedelta(seconds=1),
            idle_after=HOUR,
            allocated=by_request,
        )
        == []
    )
    assert (
        len(idle_pods([ended], in_use=set(), now=due, idle_after=HOUR, allocated=by_request)) == 1
    )
    assert next_idle_deadline([ended], in_use={"u-1"}, now=NOW, idle_after=HOUR) is None
    assert next_idle_deadline([ended], in_use=set(), now=NOW, idle_after=None) is None
