"""End to end on the real apiserver: scenario → agent → GpuNodeUsage → operator → pods."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.localcluster.cluster import LocalCluster
from gpuusage.operator.main import run_operator
from gpuusage.operator.reconcile import Reconciler
from gpuusage.operator.settings import OperatorSettings
from gpuusage.simulation import (
    Background,
)
from tests.conftest import GPU0, WorldFactory, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def world(make_world: WorldFactory) -> dict[str, Any]:
    return make_world()


def _pod(world: dict[str, Any], name: str) -> client.V1Pod:
    pod: client.V1Pod = world["core"].read_namespaced_pod(name, world["ns"])
    return pod


def _conditions(pod: client.V1Pod) -> list[client.V1PodCondition]:
    return list((pod.status.conditions if pod.status else None) or [])


def _condition(pod: client.V1Pod) -> client.V1PodCondition:
    return next(c for c in _conditions(pod) if c.type == names.POD_CONDITION_GPU_IN_USE)


def _annotations(world: dict[str, Any], name: str) -> dict[str, str]:
    meta = _pod(world, name).metadata
    return dict((meta.annotations if meta else None) or {})


def _report(world: dict[str, Any]) -> dict[str, Any]:
    report = client.CustomObjectsApi(world["api"]).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, world["node"]
    )
    assert isinstance(report, dict)
    return report


def _events(world: dict[str, Any], name: str) -> list[str]:
    events = client.EventsV1Api(world["api"]).list_namespaced_event(world["ns"])
    return sorted(str(e.reason) for e in events.items if e.regarding and e.regarding.name == name)


def test_end_to_end_annotations_conditions_events_status(world: dict[str, Any]) -> None:
    annotations = wait_for(
        lambda: (a := _annotations(world, "train")) and names.ANNOTATION_GPUS in a and a,
        what="annotations",
    )
    assert annotations[names.ANNOTATION_GPUS] == GPU0
    assert annotations[names.ANNOTATION_GPU_MEMORY_MIB] == "30720"
    usage = json.loads(annotations[names.ANNOTATION_USAGE])
    assert usage["node"] == world["node"]
    assert usage["containers"][0]["name"] == "trainer"
    assert usage["containers"][0]["devices"][0]["pids"] == [4242]
    condition = wait_for(lambda: _condition(_pod(world, "train")), what="condition")
    assert (condition.status, condition.reason) == ("True", "ProcessesRunning")
    ready = [c for c in _conditions(_pod(world, "train")) if c.type == "Ready"]
    assert [c.status for c in ready] == ["True"], "kubelet-style conditions are kept"
    assert wait_for(lambda: _events(world, "train") == ["GPUUseStarted"], what="event")

    report = _report(world)
    status = report["status"]
    assert status["totals"]["pods"] == 2
    assert status["totals"]["unattributedProcesses"] == 1
    assert status["totals"]["unrequestedPods"] == 0
    requested = {p["name"]: (p["requestedGPUs"], p["unrequested"])
                 for p in status["pods"]}  # fmt: skip
    assert requested == {"train": (1, False), "notebook": (1, False)}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Ready": "True",
                                                                      "Stale": "False"}  # fmt: skip

    # Zero pod writes and no Event for unchanged reports, while the agent keeps writing
    # heartbeats (each a new report generation, which status.observedGeneration follows).
    counts = world["reconcilers"][0].counts
    time.sleep(1.0)
    before = (counts.pod_writes, counts.events, counts.status_writes)
    time.sleep(3.5)  # three heartbeats, each a report event
    assert (counts.pod_writes, counts.events) == before[:2]
    assert counts.status_writes > before[2], "the heartbeats did reach the operator"

    # The notebook's process ends: annotations go, the condition turns False, one Event.
    world["write"](notebook=False)
    wait_for(lambda: names.ANNOTATION_GPUS not in _annotations(world, "notebook"),
          what="notebook annotations removed")  # fmt: skip
    ended = wait_for(lambda: (c := _condition(_pod(world, "notebook"))).status == "False" and c,
                  what="condition False")  # fmt: skip
    assert ended.reason == "ProcessesEnded"
    assert wait_for(lambda: _events(world, "notebook") == ["GPUUseEnded", "GPUUseStarted"],
                 what="end event")  # fmt: skip
    assert _events(world, "train") == ["GPUUseStarted"], "no Event per cycle"

    url = f"http://127.0.0.1:{world['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    counts = world["reconcilers"][0].counts
    assert f'gpuusage_operator_writes_total{{target="pod"}} {float(counts.pod_writes)}' in text
    assert 'gpuusage_operator_writes_total{target="event"} 3.0' in text
    assert "gpuusage_operator_pod_index_size " in text
    assert "gpuusage_operator_active 1.0" in text
    assert "gpuusage_operator_reports " in text
    reconciles = next(
        line
        for line in text.splitlines()
        if line.startswith("gpuusage_operator_reconcile_duration_seconds_count")
    )
    assert float(reconciles.split()[-1]) >= 3, "every report event is timed"  # fmt: skip
    echoes = next(line for line in text.splitlines()
                  if line.startswith("gpuusage_operator_echoes_skipped_total "))  # fmt: skip
    assert float(echoes.split()[-1]) >= 1, "our own status writes came back and were skipped"


def test_stale_report_marks_pods_unknown(world: dict[str, Any]) -> None:
    wait_for(lambda: _condition(_pod(world, "train")).status == "True", what="in use")
    world["agent"].halt()  # the agent dies: no more reports
    unknown = wait_for(lambda: (c := _condition(_pod(world, "train"))).status == "Unknown" and c,
                    timeout=30, what="Unknown")  # fmt: skip
    assert unknown.reason == "NodeReportStale"
    assert names.ANNOTATION_GPUS in _annotations(world, "train"), "last use kept"
    report = _report(world)
    conditions = {c["type"]: c["status"] for c in report["status"]["conditions"]}
    assert conditions == {"Ready": "False", "Stale": "True"}


def test_deleted_report_clears_its_pods(world: dict[str, Any]) -> None:
    wait_for(lambda: _condition(_pod(world, "train")).status == "True", what="in use")
    world["agent"].halt()  # otherwise the agent recreates its report
    client.CustomObjectsApi(world["api"]).delete_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, world["node"]
    )

    def cleared(name: str) -> bool:
        return names.ANNOTATION_GPUS not in _annotations(world, name)

    wait_for(lambda: cleared("train") and cleared("notebook"), what="annotations cleared")
    for name in ("train", "notebook"):
        assert _condition(_pod(world, name)).status == "False"


def test_operator_restart_rebuilds_without_writes(
    world: dict[str, Any], cluster: LocalCluster
) -> None:
    wait_for(lambda: _condition(_pod(world, "notebook")).status == "True", what="in use")
    world["operator"].halt()
    reconcilers: list[Reconciler] = []
    ready = threading.Event()
    settings = OperatorSettings(
        kubeconfig=cluster.kubeconfig, stale_after=4.0, resync=0.5, standalone=True
    )
    again = Background(lambda stop: run_operator(settings, stop, ready, reconcilers))
    try:
        assert ready.wait(60)
        time.sleep(3.0)  # initial listing plus a few heartbeats
        counts = reconcilers[0].counts
        assert (counts.pod_writes, counts.events) == (0, 0), "what is right is left alone"
        assert counts.status_writes > 0, "the new operator did reconcile the reports"
    finally:
        again.halt()


def test_pod_deleted_while_its_process_is_still_reported(world: dict[str, Any]) -> None:
    wait_for(lambda: _condition(_pod(world, "notebook")).status == "True", what="in use")
    world["core"].delete_namespaced_pod("notebook", world["ns"], grace_period_seconds=0)

    def notebook_unattributed() -> bool:
        status = _report(world)["status"]
        return any(
            u["pid"] == 5151 and u["reason"] == "PodNotFound" for u in status["unattributed"]
        )

    wait_for(notebook_unattributed, what="the deleted pod's process to be reported as PodNotFound")
    status = _report(world)["status"]
    assert status["totals"]["pods"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    assert _condition(_pod(world, "train")).status == "True", "the other pod is unaffected"
    assert world["reconcilers"][0].counts.pod_errors == 0


def test_annotation_removed_by_someone_else_is_restored(world: dict[str, Any]) -> None:
    """The last-applied cache must never mask what is really on the pod."""
    wait_for(lambda: names.ANNOTATION_GPUS in _annotations(world, "train"), what="annotations")
    before = _annotations(world, "train")
    patch = {"metadata": {"annotations": {names.ANNOTATION_GPUS: None}}}
    world["core"].patch_namespaced_pod("train", world["ns"], patch)
    restored = wait_for(
        lambda: (a := _annotations(world, "train")) and names.ANNOTATION_GPUS in a and a,
        what="the operator to restore its annotation on the next report",
    )
    assert restored[names.ANNOTATION_GPUS] == before[names.ANNOTATION_GPUS]
    assert world["reconcilers"][0].counts.pod_errors == 0


def test_requested_gpus_left_idle_are_flagged(make_world: WorldFactory) -> None:
    """A pod that never used its GPUs, and one whose use ended, both flagged after idle_after,
    each once (no flip-flop between reasons), and unflagged when use starts again."""
    world = make_world({"train": 1, "notebook": 1, "waiter": 2}, idle_after=3.0)

    def idle_names() -> list[str]:
        return [p["name"] for p in (_report(world).get("status") or {}).get("idlePods", [])]

    def reason(name: str) -> str | None:
        found = [c for c in _conditions(_pod(world, name))
                 if c.type == names.POD_CONDITION_GPU_IN_USE]  # fmt: skip
        return f"{found[0].status} {found[0].reason}" if found else None

    wait_for(lambda: idle_names() == ["waiter"], timeout=30, what="waiter flagged idle")
    assert reason("waiter") == "False RequestedGPUsIdle"
    waiter = _condition(_pod(world, "waiter"))
    pod_status = _pod(world, "waiter").status
    assert pod_status is not None
    assert waiter.last_transition_time == pod_status.start_time, "idle since the pod started"
    assert "requests 2 GPUs" in str(waiter.message)
    status = _report(world)["status"]
    assert status["totals"]["idlePods"] == 1
    assert status["idlePods"][0]["requestedGPUs"] == 2
    assert wait_for(lambda: _events(world, "waiter") == ["RequestedGPUsIdle"], what="event")
    assert reason("train") == "True ProcessesRunning", "pods in use are never idle"

    world["write"](notebook=False)  # the notebook's use ends; it keeps its GPU
    wait_for(lambda: reason("notebook") == "False ProcessesEnded", what="use ended")
    wait_for(lambda: idle_names() == ["notebook", "waiter"], timeout=30, what="notebook idle")
    assert reason("notebook") == "False RequestedGPUsIdle"
    # The Event follows the condition write: wait for it before counting.
    flagged = ["GPUUseEnded", "GPUUseStarted", "RequestedGPUsIdle"]
    assert wait_for(lambda: _events(world, "notebook") == flagged, what="idle event")
    counts = world["reconcilers"][0].counts
    before = (counts.pod_writes, counts.events)
    time.sleep(3.0)  # several heartbeats: the idle pods stay flagged without a write
    assert (counts.pod_writes, counts.events) == before
    assert _events(world, "notebook") == flagged

    world["write"](notebook=True)  # back at work: no longer idle
    wait_for(lambda: reason("notebook") == "True ProcessesRunning", what="notebook in use")
    wait_for(lambda: idle_names() == ["waiter"], what="notebook unflagged")
