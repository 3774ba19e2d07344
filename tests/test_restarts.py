"""A container restart is continuous use (see operator restarts): what the kubelet says about a
container's exits, and the verdicts and Events that follow from it. Pure."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage_operator.index.pods import PodSnapshot, container_exits, snapshot_of
from gpuusage_operator.judge.certainty import BlindSpots
from gpuusage_operator.judge.podstate import desired_condition, verdicts
from gpuusage_operator.judge.restarts import (
    REASON_RESTARTED,
    SETTLE,
    restart_cause,
    settle_until,
)
from gpuusage_operator.writers.marks import event_for, plan_pod

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=UTC)
GRACE = timedelta(seconds=60)
SEEN = BlindSpots(reported=frozenset({"GPU-1"}))
"""A report that lists the pod's device and sees everything."""
IN_USE = (("lastTransitionTime", "2026-11-25T11:00:00Z"), ("reason", "ProcessesRunning"))


def _status(phase: str, **container: Any) -> dict[str, Any]:
    return {"phase": phase, "containerStatuses": [{"name": "trainer", **container}]}


def _exited(seconds_ago: float, code: int = 1) -> dict[str, Any]:
    at = format_time(NOW - timedelta(seconds=seconds_ago))
    return {"terminated": {"exitCode": code, "finishedAt": at}}


@pytest.mark.parametrize(
    ("status", "policy", "expected"),
    [
        # restarted: the exit before the running container is in lastState
        (_status("Running", state={"running": {}}, lastState=_exited(3)), None, 3),
        # exited, restart to come (backing off): its state
        (_status("Running", state=_exited(2)), "Always", 2),
        (_status("Running", state=_exited(2, code=0)), "OnFailure", None),
        (_status("Running", state=_exited(2, code=137)), "OnFailure", 2),
        # restartPolicy Never: the exit is final
        (_status("Running", state=_exited(2)), "Never", None),
        # waiting in CrashLoopBackOff: the last exit is in lastState
        (_status("Running", state={"waiting": {}}, lastState=_exited(9)), "Always", 9),
        # a pod that ended restarts nothing, whatever its policy
        (_status("Succeeded", state=_exited(2, code=0)), "Always", None),
        (_status("Running", state={"running": {}}), None, None),
    ],
)
def test_the_exits_a_restart_follows(
    status: dict[str, Any], policy: str | None, expected: float | None
) -> None:
    found = container_exits(status, policy)
    if expected is None:
        assert found == ()
    else:
        assert found == (("trainer", format_time(NOW - timedelta(seconds=expected))),)


def _pod(
    exits: tuple[tuple[str, str], ...] = (),
    *,
    running: bool = True,
    condition: str = "True",
    containers: list[str] | None = None,
) -> PodSnapshot:
    usage = {"containers": [{"name": c, "devices": []} for c in containers or ["trainer"]]}
    return PodSnapshot(
        "ml",
        "train",
        "uid-1",
        "gpu-node-a",
        annotations=((names.ANNOTATION_GPUS, "GPU-1"), (names.ANNOTATION_USAGE, json.dumps(usage))),
        condition=(("status", condition), ("type", names.POD_CONDITION_GPU_IN_USE), *IN_USE),
        running=running,
        exits=exits,
    )


def _ago(seconds: float) -> tuple[tuple[str, str], ...]:
    return (("trainer", format_time(NOW - timedelta(seconds=seconds))),)


def test_a_recent_exit_of_a_gpu_container_is_a_restart_until_the_grace_ends() -> None:
    cause = restart_cause(_pod(_ago(10)), NOW, GRACE)
    assert cause is not None
    assert cause.reason == REASON_RESTARTED
    assert cause.until == NOW + timedelta(seconds=50)
    assert "container trainer exited at 2026-11-25T11:59:50Z" in cause.message
    assert restart_cause(_pod(_ago(60)), NOW, GRACE) is None, "the grace is over"
    assert restart_cause(_pod(_ago(10)), NOW, timedelta(0)) is None, "grace 0: no restarts"


def test_only_a_running_pod_in_use_whose_gpu_container_exited_is_restarting() -> None:
    assert restart_cause(_pod(), NOW, GRACE) is None, "no exit"
    assert restart_cause(_pod(_ago(5), running=False), NOW, GRACE) is None
    assert restart_cause(_pod(_ago(5), condition="False"), NOW, GRACE) is None
    sidecar = (("logger", format_time(NOW - timedelta(seconds=5))),)
    assert restart_cause(_pod(sidecar), NOW, GRACE) is None, "not the GPU's container"
    unknown_containers = PodSnapshot(
        "ml",
        "train",
        "uid-1",
        "gpu-node-a",
        condition=(("status", "True"), ("type", names.POD_CONDITION_GPU_IN_USE)),
        running=True,
        exits=sidecar,
    )
    assert restart_cause(unknown_containers, NOW, GRACE) is not None, "any may be the GPU's"
    assert restart_cause(_pod((("trainer", "garbled"),)), NOW, GRACE) is None


def test_a_restarting_pod_is_unknown_without_events_and_goes_on_when_seen_again() -> None:
    pod = _pod(_ago(3))
    (verdict,) = verdicts({}, [pod], [], stale=False, blind=SEEN, restarts=(NOW, GRACE))
    assert (verdict.state, verdict.unknown and verdict.unknown.reason) == (
        "Unknown",
        REASON_RESTARTED,
    )
    shown = dict(pod.condition)
    assert verdict.marks is not None
    plan = plan_pod(verdict.marks, pod.our_annotations, shown, NOW)
    assert plan.condition["status"] == "Unknown"
    assert plan.annotation_patch is None, "last known use kept"
    assert plan.event is None, "a restart is no end of use"
    (without,) = verdicts({}, [pod], [], stale=False, blind=SEEN)
    assert without.state == "Stopped", "no clock given: a report alone ends use"
    back = {**dict(IN_USE), "type": names.POD_CONDITION_GPU_IN_USE, "status": "True"}
    assert event_for(plan.condition, back) is None, "use went on"
    ended = desired_condition("Stopped", None, "gpu-node-a")
    assert event_for(plan.condition, ended) is not None, "the grace over: use ended"


def test_marks_settle_for_a_running_pod_in_use_only() -> None:
    first = NOW
    assert settle_until(_pod(), first, NOW) == NOW + SETTLE
    assert settle_until(_pod(), first, NOW + SETTLE) is None, "settled: act"
    assert settle_until(_pod(running=False), first, NOW) is None, "a pod that ended: act now"
    assert settle_until(_pod(condition="Unknown"), first, NOW) is None


def test_the_judge_holds_a_verdict_while_the_marks_settle() -> None:
    """The hold is the judge's: a pod marked in use whose processes a report no longer shows
    settles from the first such report (its time kept by the caller between reports), the
    report wakes then, and once settled the verdict stands with nothing held."""
    pod = _pod()
    (held,) = verdicts({}, [pod], [], stale=False, blind=SEEN, restarts=(NOW, GRACE))
    assert (held.state, held.settles_until, held.absent_since) == ("Stopped", NOW + SETTLE, NOW)
    assert held.wakes == NOW + SETTLE
    later = NOW + timedelta(seconds=2)
    (still,) = verdicts(
        {}, [pod], [], stale=False, blind=SEEN, restarts=(later, GRACE), absent={pod.uid: NOW}
    )
    assert (still.settles_until, still.absent_since) == (NOW + SETTLE, NOW), "from the first"
    settled = NOW + SETTLE
    (ended,) = verdicts(
        {}, [pod], [], stale=False, blind=SEEN, restarts=(settled, GRACE), absent={pod.uid: NOW}
    )
    assert (ended.state, ended.settles_until, ended.absent_since) == ("Stopped", None, None)
    assert ended.wakes is None
    (restarting,) = verdicts(
        {},
        [_pod(_ago(10))],
        [],
        stale=False,
        blind=SEEN,
        restarts=(settled, GRACE),
        absent={pod.uid: NOW},
    )
    assert restarting.settles_until is None
    assert restarting.wakes == NOW - timedelta(seconds=10) + GRACE, "the grace's end"


def test_the_index_carries_the_exits() -> None:
    body = {
        "metadata": {"name": "train", "namespace": "ml", "uid": "u"},
        "spec": {"restartPolicy": "Always", "containers": [{"name": "trainer"}]},
        "status": _status(
            "Running",
            containerID="containerd://" + "a" * 64,
            state={"running": {}},
            lastState=_exited(4),
        ),
    }
    found = snapshot_of(body)
    assert found is not None
    assert found.exits == _ago(4)
