"""The operator's pure core: pod index entries, resolution, desired status and pod state."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuusage.api import names
from gpuusage.api.models import Process
from gpuusage_operator.index.pods import snapshot_of
from gpuusage_operator.judge.allocation import judgements
from gpuusage_operator.judge.freshness import Sighting, freshness
from gpuusage_operator.judge.podstate import desired_annotations, desired_condition, usage_json
from gpuusage_operator.judge.requests import gpu_requests
from gpuusage_operator.judge.resolution import pod_uses, resolve_all, resolve_process
from gpuusage_operator.judge.status import compute_share, desired_status
from gpuusage_operator.writers.marks import (
    DETAIL_EVERY,
    annotation_patch,
    condition_patch,
    event_for,
    held_detail,
)
from tests.builders import api_pod, index_keys, pod_lookup
from tests.examples import (
    CTR_INFER,
    CTR_NOTEBOOK,
    CTR_TRAIN,
    POD_INFER,
    POD_NOTEBOOK,
    POD_TRAIN,
    example_spec,
)

NOW = datetime(2026, 11, 21, 12, 0, 30, tzinfo=UTC)
OBSERVED = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
NODE = "gpu-node-a"
SEEN = Sighting(3, OBSERVED)


PODS = (
    api_pod("train-0", POD_TRAIN, {"trainer": CTR_TRAIN}),
    api_pod("notebook", POD_NOTEBOOK, {"jupyter": CTR_NOTEBOOK}, ns="alice"),
    api_pod("triton", POD_INFER, {"server": CTR_INFER}, ns="serving"),
)


def test_index_entry_is_small_and_strips_the_runtime_scheme() -> None:
    body = api_pod("p", POD_TRAIN, {"a": "ABC" + "0" * 61})
    body["status"]["initContainerStatuses"] = [
        {"name": "init", "containerID": "cri-o://" + "1" * 64}
    ]
    body["status"]["containerStatuses"].append({"name": "waiting"})  # no ID yet
    body["spec"]["containers"] = [{"name": "big", "env": [{"name": "X", "value": "y" * 10_000}]}]
    assert set(index_keys(body)) == {"cid:abc" + "0" * 61, "cid:" + "1" * 64}
    ref = snapshot_of(body)
    assert ref is not None
    assert ref.container_name("1" * 64) == "init"
    assert len(repr(ref)) < 600, "only the few fields needed are kept"
    assert snapshot_of({"metadata": {"name": "no-uid"}}) is None


def test_resolution_order_of_evidence() -> None:
    pods = pod_lookup(*PODS)
    by_container = resolve_process(NODE, "GPU-x", Process(pid=1, container_id=CTR_TRAIN), pods)
    assert by_container.pod is not None
    assert (by_container.pod.name, by_container.container_name) == ("train-0", "trainer")
    # After a container restart the new ID is not in the pod's status yet: matched by UID.
    restarted = Process(pid=2, container_id="f" * 64, pod_uid=POD_TRAIN)
    by_uid = resolve_process(NODE, "GPU-x", restarted, pods)
    assert by_uid.pod is not None
    assert by_uid.container_name is None
    gone = resolve_process(
        NODE, "GPU-x", Process(pid=3, pod_uid="11111111-2222-4333-8444-555555555555"), pods
    )
    assert (gone.pod, gone.reason) == (None, "PodNotFound")
    stray = resolve_process(NODE, "GPU-x", Process(pid=4, container_id="e" * 64), pods)
    assert stray.reason == "UnknownContainer"
    lost = resolve_process(NODE, "GPU-x", Process(pid=5, resolve_error="pid 5 not found"), pods)
    assert (lost.reason, lost.message) == ("Unresolved", "pid 5 not found")
    assert resolve_process(NODE, "GPU-x", Process(pid=6), pods).reason == "HostProcess"


def test_a_report_attributes_processes_only_to_pods_of_its_own_node() -> None:
    """A report of node B naming a pod of node A (by container ID or by UID) leaves it alone."""
    elsewhere = api_pod("web", POD_INFER, {"server": CTR_INFER}, ns="serving")
    pending = api_pod("queued", POD_NOTEBOOK, {"jupyter": CTR_NOTEBOOK})
    del pending["spec"]["nodeName"]
    pods = pod_lookup(api_pod("train-0", POD_TRAIN, {"trainer": CTR_TRAIN}), elsewhere, pending)
    for process in (
        Process(pid=1, container_id=CTR_INFER),
        Process(pid=2, pod_uid=POD_INFER),
        Process(pid=3, container_id=CTR_INFER, pod_uid=POD_INFER),
    ):
        found = resolve_process("gpu-node-b", "GPU-x", process, pods)
        assert (found.pod, found.reason) == (None, "PodOnOtherNode")
        assert "on node gpu-node-a, not on gpu-node-b" in found.message
        assert "web" not in found.message, "nothing about another node's pod leaks"
    unscheduled = resolve_process(NODE, "GPU-x", Process(pid=4, pod_uid=POD_NOTEBOOK), pods)
    assert (unscheduled.pod, unscheduled.reason) == (None, "PodOnOtherNode")
    assert "not scheduled" in unscheduled.message
    own = resolve_process(NODE, "GPU-x", Process(pid=5, container_id=CTR_TRAIN), pods)
    assert own.pod is not None
    assert own.pod.name == "train-0"


def test_desired_status_of_the_example_node() -> None:
    spec = example_spec("gpu-node-a", OBSERVED)
    resolutions = list(resolve_all(spec, pod_lookup(*PODS)))
    status = desired_status(
        spec, resolutions, NOW, generation=3, fresh=freshness(SEEN, None, None, NOW)
    )
    assert status.observed_generation == 3
    assert status.totals is not None
    assert (status.totals.pods, status.totals.processes, status.totals.unattributed_processes) == (
        3,
        4,
        1,
    )
    gpu0 = status.devices[0]
    on_gpu0 = [p for p in status.pods if p.device_uuid == gpu0.uuid]
    assert [p.name for p in on_gpu0] == ["notebook", "train-0"], "several pods on one GPU"
    assert on_gpu0[1].containers[0].name == "trainer"
    assert on_gpu0[1].containers[0].pids == [4242]
    assert on_gpu0[1].used_memory_mib == 30720
    assert (gpu0.index, gpu0.pods, gpu0.processes, gpu0.unattributed_processes) == (0, 2, 3, 1)
    assert gpu0.unattributed_memory_mib == sum(
        u.used_memory_mib or 0 for u in status.unattributed if u.device_uuid == gpu0.uuid
    )
    assert gpu0.total_memory_mib == spec.gpus[0].memory.total_mib  # type: ignore[union-attr]
    mig = next(d for d in status.devices if d.uuid.startswith("MIG-"))
    assert mig.parent_uuid is not None
    assert mig.parent_uuid != mig.uuid
    assert [p.name for p in status.pods if p.device_uuid == mig.uuid] == ["triton"]
    assert len(status.devices) == len(spec.gpus) + sum(len(g.mig_devices) for g in spec.gpus), (
        "every device is listed, idle ones included"
    )
    assert [(u.pid, u.reason) for u in status.unattributed] == [(777, "HostProcess")]
    conditions = {c.type: c for c in status.conditions}
    assert conditions["Ready"].status == "True"
    assert conditions["Stale"].status == "False"


def test_status_is_identical_for_an_unchanged_report() -> None:
    spec = example_spec("gpu-node-a", OBSERVED)
    resolutions = list(resolve_all(spec, pod_lookup(*PODS)))
    first = desired_status(
        spec, resolutions, NOW, generation=3, fresh=freshness(SEEN, None, None, NOW)
    )
    again = desired_status(
        spec,
        list(reversed(resolutions)),
        NOW + timedelta(seconds=40),
        generation=3,
        fresh=freshness(SEEN, None, None, NOW),
        previous=first,
    )
    assert again == first


def test_stale_report_makes_the_node_not_ready() -> None:
    spec = example_spec("gpu-node-a", OBSERVED)
    status = desired_status(
        spec,
        [],
        OBSERVED + timedelta(minutes=10),
        generation=1,
        fresh=freshness(Sighting(1, OBSERVED), None, None, OBSERVED + timedelta(minutes=10)),
    )
    conditions = {c.type: c for c in status.conditions}
    assert (conditions["Stale"].status, conditions["Ready"].status) == ("True", "False")
    assert conditions["Ready"].reason == "ReportStale"


def _uses() -> dict[str, Any]:
    spec = example_spec("gpu-node-a", OBSERVED)
    return pod_uses("gpu-node-a", OBSERVED, resolve_all(spec, pod_lookup(*PODS)))


def test_pod_annotations_follow_the_design() -> None:
    train = _uses()[POD_TRAIN]
    wanted = desired_annotations(train)
    assert wanted[names.ANNOTATION_GPUS] == "GPU-11111111-2222-3333-4444-555555555555"
    assert wanted[names.ANNOTATION_GPU_MEMORY_MIB] == "30720"
    usage = json.loads(wanted[names.ANNOTATION_USAGE])
    assert usage == {
        "node": "gpu-node-a",
        "observedAt": "2026-11-21T12:00:00Z",
        "containers": [
            {
                "name": "trainer",
                "devices": [
                    {
                        "uuid": "GPU-11111111-2222-3333-4444-555555555555",
                        "mib": 30720,
                        "pids": [4242],
                    }
                ],
            }
        ],
        "requestedGPUs": 1,
    }


def test_usage_annotation_is_bounded_with_a_marker() -> None:
    train = _uses()[POD_TRAIN]
    many = tuple(
        type(train.resolutions[0])(
            device_uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            process=Process(pid=1000 + i, used_memory_mib=10),
            pod=train.pod,
            container_name=f"worker-{i:03d}",
        )
        for i in range(200)
    )
    big = type(train)(train.pod, train.node, train.observed_at, many)
    text = usage_json(big, max_bytes=2048)
    assert len(text) <= 2048
    doc = json.loads(text)
    assert doc["truncated"] is True
    assert 0 < len(doc["containers"]) < 200
    assert "pids" not in doc["containers"][0]["devices"][0]


def _with_processes(use: Any, **update: Any) -> Any:
    """The use with each of its processes updated so."""
    return type(use)(
        use.pod,
        use.node,
        use.observed_at,
        tuple(
            type(r)(**{**r.__dict__, "process": r.process.model_copy(update=update)})
            for r in use.resolutions
        ),
    )


def test_patches_are_empty_when_nothing_changes() -> None:
    use = _uses()[POD_TRAIN]
    wanted = desired_annotations(use)
    assert annotation_patch(wanted, wanted) is None
    later = type(use)(use.pod, use.node, use.observed_at + timedelta(minutes=1), use.resolutions)
    assert shown_patch(wanted, desired_annotations(later)) is None, "a heartbeat alone"
    assert annotation_patch({}, wanted) == wanted
    cleared = annotation_patch({**wanted, "other.io/keep": "x"}, None)
    assert cleared == dict.fromkeys(wanted), "use ended: our annotations removed, others kept"
    condition = desired_condition("InUse", use, "gpu-node-a")
    assert condition["status"] == "True"
    assert "1 process on node gpu-node-a uses GPU-11111111" in condition["message"]
    grown = _with_processes(use, used_memory_mib=1)
    assert desired_annotations(grown) != wanted
    assert desired_condition("InUse", grown, "gpu-node-a") == condition, (
        "a memory change alone is one pod write (annotations), not two"
    )
    first = condition_patch([{"type": "Ready", "status": "True"}], condition, NOW)
    assert first is not None
    assert first["lastTransitionTime"] == "2026-11-21T12:00:30Z"
    assert condition_patch([first], condition, NOW + timedelta(minutes=1)) is None
    ended = condition_patch(
        [first], desired_condition("Stopped", None, "gpu-node-a"), NOW + timedelta(minutes=2)
    )
    assert ended is not None
    assert (ended["status"], ended["reason"]) == ("False", "ProcessesEnded")
    assert ended["lastTransitionTime"] == "2026-11-21T12:02:30Z"


def test_the_usage_annotation_follows_a_share_only_when_it_moves_a_tenth() -> None:
    """A container's share of a device is in its usage detail; a move of a few points (the
    agent republishes at 5, and other changes on the node carry small ones along) rewrites no
    pod; a move of a tenth does, and so does a share coming or going."""
    use = _uses()[POD_TRAIN]

    def annotated(share: float | None) -> dict[str, str]:
        return desired_annotations(_with_processes(use, compute_share=share))

    measured = annotated(0.42)
    device = json.loads(measured[names.ANNOTATION_USAGE])["containers"][0]["devices"][0]
    assert device["share"] == 0.42
    assert shown_patch(measured, annotated(0.49)) is None
    assert shown_patch(measured, annotated(0.52)) is not None
    assert shown_patch(measured, annotated(None)) is not None
    assert shown_patch(desired_annotations(use), measured) is not None
    assert shown_patch(annotated(0.2), annotated(0.3)) is not None, "a tenth, exactly"
    assert shown_patch(annotated(0.6), annotated(0.7)) is not None, "a tenth, exactly"


def shown_patch(
    current: dict[str, str], desired: dict[str, str], now: datetime | None = None
) -> dict[str, str | None] | None:
    """The annotations' patch once the detail rule has held back what it holds back (by
    default DETAIL_EVERY after the detail shown was observed: nothing is held for time)."""
    observed = datetime.fromisoformat(json.loads(current[names.ANNOTATION_USAGE])["observedAt"])
    held, _ = held_detail(current, desired, now or observed + DETAIL_EVERY)
    return annotation_patch(current, held)


def test_the_detail_moves_on_the_pod_in_steps_at_most_once_every_ten_minutes() -> None:
    """The devices and the containers on them are written at once; the memory only when it
    moved by a tenth of what is shown (and 256 MiB), and then DETAIL_EVERY after the detail
    shown was observed: a growing allocator costs a write per ten minutes at most, a steady
    server none."""
    use = _uses()[POD_TRAIN]  # 30,720 MiB, observed at 12:00:00
    shown = desired_annotations(use)
    since = use.observed_at

    def at(minutes: float, mib: int) -> tuple[dict[str, str] | None, datetime | None]:
        moved = type(use)(
            use.pod,
            use.node,
            since + timedelta(minutes=minutes),
            _with_processes(use, used_memory_mib=mib).resolutions,
        )
        return held_detail(shown, desired_annotations(moved), since + timedelta(minutes=minutes))

    kept, due = at(1, 30720 + 2048)
    assert (kept, due) == (shown, None), "less than a tenth: no move"
    kept, due = at(1, 40000)
    assert kept == shown, "moved, within ten minutes of the last: held"
    assert due == since + DETAIL_EVERY
    written, due = at(10, 40000)
    assert written is not None
    assert written[names.ANNOTATION_GPU_MEMORY_MIB] == "40000"
    assert due is None
    assert at(10, 30720 + 255)[0] == shown, "small pods: 256 MiB at least"
    restarted = type(use)(
        use.pod,
        use.node,
        since,
        tuple(
            type(r)(**{**r.__dict__, "process": r.process.model_copy(update={"pid": 4343})})
            for r in use.resolutions
        ),
    )
    new_pid = desired_annotations(restarted)
    assert held_detail(shown, new_pid, since + timedelta(minutes=1)) == (
        {
            **new_pid,
            **{k: shown[k] for k in (names.ANNOTATION_GPU_MEMORY_MIB, names.ANNOTATION_USAGE)},
        },
        since + DETAIL_EVERY,
    ), "another pid: news, at the detail's pace"
    assert held_detail(shown, new_pid, since + DETAIL_EVERY) == (new_pid, None)
    edited = {**shown, names.ANNOTATION_GPU_MEMORY_MIB: "1"}  # by hand: put right at once
    assert held_detail(edited, shown, since + timedelta(minutes=1)) == (shown, None)
    assert annotation_patch(edited, shown) == {names.ANNOTATION_GPU_MEMORY_MIB: "30720"}
    other = {**shown, names.ANNOTATION_GPUS: "GPU-other"}
    assert held_detail(shown, other, since) == (other, None), "devices: at once"
    ahead = held_detail(shown, desired_annotations(use), since - timedelta(hours=1))
    assert ahead[0] == shown, "nothing moved"
    grown = desired_annotations(_with_processes(use, used_memory_mib=60000))
    assert held_detail(shown, grown, since - timedelta(hours=1)) == (grown, None), (
        "a time shown ahead of the operator's clock holds nothing back"
    )


@pytest.mark.parametrize(
    ("before", "after", "event"),
    [
        (None, "True ProcessesRunning", "GPUUseStarted Normal"),
        ("False ProcessesEnded", "True ProcessesRunning", "GPUUseStarted Normal"),
        ("True ProcessesRunning", "True ProcessesRunning", None),
        ("True ProcessesRunning", "False ProcessesEnded", "GPUUseEnded Normal"),
        ("Unknown NodeReportStale", "False ProcessesEnded", "GPUUseEnded Normal"),
        ("True ProcessesRunning", "Unknown NodeReportStale", None),
        (None, "False ProcessesEnded", None),
        (None, "True UsingUnrequestedGPU", "UsingUnrequestedGPU Warning"),
        ("True ProcessesRunning", "True UsingUnrequestedGPU", "UsingUnrequestedGPU Warning"),
        ("True UsingUnrequestedGPU", "True UsingUnrequestedGPU", None),
        ("False ProcessesEnded", "False RequestedGPUsIdle", "RequestedGPUsIdle Warning"),
        (None, "False RequestedGPUsIdle", "RequestedGPUsIdle Warning"),
        ("False RequestedGPUsIdle", "False RequestedGPUsIdle", None),
        ("False RequestedGPUsIdle", "True ProcessesRunning", "GPUUseStarted Normal"),
    ],
)
def test_events_only_on_transitions(before: str | None, after: str, event: str | None) -> None:
    def condition(text: str) -> dict[str, str]:
        status, reason = text.split()
        return {"type": "gpuusage.io/GPUInUse", "status": status, "reason": reason}

    found = event_for(condition(before) if before else None, condition(after))
    assert (f"{found.reason} {found.type}" if found else None) == event


def test_marked_pods_are_found_per_node_without_a_scan() -> None:
    marked = api_pod("a", POD_TRAIN, {"x": CTR_TRAIN})
    marked["metadata"]["annotations"] = {names.ANNOTATION_GPUS: "GPU-1", "other/key": "v"}
    marked["metadata"]["resourceVersion"] = "42"
    elsewhere = api_pod("b", POD_INFER, {"y": CTR_INFER})
    elsewhere["spec"]["nodeName"] = "gpu-node-b"
    elsewhere["status"]["conditions"] = [
        {"type": names.POD_CONDITION_GPU_IN_USE, "status": "False"}
    ]
    unmarked = api_pod("c", POD_NOTEBOOK, {"z": CTR_NOTEBOOK})
    pods = pod_lookup(marked, elsewhere, unmarked)
    assert [r.name for r in pods.on_node_with_our_marks("gpu-node-a")] == ["a"]
    assert [r.name for r in pods.on_node_with_our_marks("gpu-node-b")] == ["b"]
    assert pods.on_node_with_our_marks("gpu-node-c") == []
    ref = pods.by_uid(POD_TRAIN)
    assert ref is not None
    assert ref.resource_version == "42"
    assert ref.our_annotations == {names.ANNOTATION_GPUS: "GPU-1"}, "only our own annotations"


def test_gpu_requests_and_use_of_unrequested_gpus() -> None:
    spec = {
        "containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
            {"resources": {"limits": {"nvidia.com/mig-1g.10gb": "1", "memory": "1Gi"}}},
            {"resources": {"limits": {"nvidia.com/gpu": "lots"}}},  # ignored, not a count
            {},
        ],
        "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}],
    }
    assert gpu_requests(spec) == 4, "the largest init container wins over the sum (3)"
    assert gpu_requests({"containers": spec["containers"]}) == 3
    assert gpu_requests({}) == 0
    sneaky = api_pod("sneaky", POD_TRAIN, {"trainer": CTR_TRAIN}, gpus=0)
    honest = api_pod("notebook", POD_NOTEBOOK, {"jupyter": CTR_NOTEBOOK}, ns="alice")
    spec_ = example_spec("gpu-node-a", OBSERVED)
    status = desired_status(
        spec_,
        list(resolve_all(spec_, pod_lookup(sneaky, honest))),
        NOW,
        generation=1,
        fresh=freshness(SEEN, None, None, NOW),
    )
    flags = {(p.name, p.requested_gpus, p.unrequested) for p in status.pods}
    assert flags == {("sneaky", 0, True), ("notebook", 1, False)}
    assert status.totals is not None
    assert status.totals.unrequested_pods == 1
    uses = pod_uses("gpu-node-a", OBSERVED, resolve_all(spec_, pod_lookup(sneaky, honest)))
    judged = judgements(uses, spec_)
    condition = desired_condition(
        "InUse", uses[POD_TRAIN], "gpu-node-a", judgement=judged[POD_TRAIN]
    )
    assert (condition["status"], condition["reason"]) == ("True", "UsingUnrequestedGPU")
    notebook = desired_condition(
        "InUse", uses[POD_NOTEBOOK], "gpu-node-a", judgement=judged[POD_NOTEBOOK]
    )
    assert notebook["reason"] == "ProcessesRunning"
    unjudged = desired_condition("InUse", uses[POD_TRAIN], "gpu-node-a")
    assert unjudged["reason"] == "ProcessesRunning", "no judgement, no finding: no second rule"


def test_a_pods_share_of_a_device_adds_its_processes_up() -> None:
    """status.pods[].computeShare: the pod's processes' shares on the device added up, those
    without one left out; absent when none has one."""
    told = [Process(pid=1, compute_share=0.25), Process(pid=2, compute_share=0.125)]
    assert compute_share([*told, Process(pid=3)]) == 0.375
    assert compute_share([Process(pid=3)]) is None
    assert (
        compute_share([Process(pid=1, compute_share=0.7), Process(pid=2, compute_share=0.6)]) == 1
    )
