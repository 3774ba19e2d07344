"""End to end on the real apiserver: scenario → agent → GpuNodeUsage → operator → pods."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import (
    Background,
)
from gpuusage_operator.main import Operator
from gpuusage_operator.settings import OperatorSettings
from tests.conftest import GPU0, WorldFactory, wait_for
from tests.simworld import SimWorld
from tests.worldview import condition, conditions, events, pod, pod_annotations, report

pytestmark = pytest.mark.cluster


@pytest.fixture
def world(make_world: WorldFactory) -> SimWorld:
    return make_world()


def test_end_to_end_annotations_conditions_events_status(world: SimWorld) -> None:
    marks = wait_for(
        lambda: (a := pod_annotations(world, "train")) and names.ANNOTATION_GPUS in a and a,
        what="annotations",
    )
    assert marks[names.ANNOTATION_GPUS] == GPU0
    assert marks[names.ANNOTATION_GPU_MEMORY_MIB] == "30720"
    usage = json.loads(marks[names.ANNOTATION_USAGE])
    assert usage["node"] == world.node
    assert usage["containers"][0]["name"] == "trainer"
    assert usage["containers"][0]["devices"][0]["pids"] == [4242]
    found = wait_for(lambda: condition(pod(world, "train")), what="condition")
    assert (found.status, found.reason) == ("True", "ProcessesRunning")
    ready = [c for c in conditions(pod(world, "train")) if c.type == "Ready"]
    assert [c.status for c in ready] == ["True"], "kubelet-style conditions are kept"
    assert wait_for(lambda: events(world, "train") == ["GPUUseStarted"], what="event")

    # The report's status is written after the pods (what people read comes first).
    status = wait_for(lambda: report(world)["status"], what="the report's status")
    assert status["totals"]["pods"] == 2
    assert status["totals"]["unattributedProcesses"] == 1
    assert status["totals"]["unrequestedPods"] == 0
    # Fields at their default (0, false) are left out of list items.
    requested = {
        p["name"]: (p.get("requestedGPUs", 0), p.get("unrequested", False)) for p in status["pods"]
    }
    assert requested == {"train": (1, False), "notebook": (1, False)}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True",
        "Stale": "False",
    }

    # Zero pod writes and no Event for unchanged reports, while the agent keeps writing
    # heartbeats (each a new report generation, which status.observedGeneration follows).
    # (The operator also reconciles other tests' reports on the shared cluster: what is counted
    # here is this world's pods and report.)
    def versions() -> dict[str, str]:
        return {
            n: str(getattr(pod(world, n).metadata, "resource_version", None))
            for n in ("train", "notebook")
        }

    before, seen = versions(), (events(world, "train"), events(world, "notebook"))
    generation = report(world)["metadata"]["generation"]

    def reconciled(at_least: int) -> bool:
        got = report(world)
        return bool(
            got["status"]["observedGeneration"] == got["metadata"]["generation"] >= at_least
        )

    wait_for(lambda: reconciled(generation + 3), what="three heartbeats reconciled")
    assert versions() == before, "no write to the pods"
    assert (events(world, "train"), events(world, "notebook")) == seen, "no Event"

    # The notebook's process ends: annotations go, the condition turns False, one Event.
    world.write(notebook=False)
    wait_for(
        lambda: names.ANNOTATION_GPUS not in pod_annotations(world, "notebook"),
        what="notebook annotations removed",
    )
    ended = wait_for(
        lambda: (c := condition(pod(world, "notebook"))).status == "False" and c,
        what="condition False",
    )
    assert ended.reason == "ProcessesEnded"
    assert wait_for(
        lambda: events(world, "notebook") == ["GPUUseEnded", "GPUUseStarted"], what="end event"
    )
    assert events(world, "train") == ["GPUUseStarted"], "no Event per cycle"

    url = f"http://127.0.0.1:{world.metrics_port}/metrics"

    def scraped() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    # The metrics say the operator's own counts. An Event is counted once its create has
    # answered (it may show in a list first), and the operator writes about other tests' pods
    # on the shared cluster too: scraped until the scrape and the counts agree.
    counts = world.reconciler.counts

    def agreeing() -> str | None:
        text = scraped()
        said = {
            'gpuusage_operator_writes_total{target="event"} ' + str(float(counts.events)),
            'gpuusage_operator_writes_total{target="pod"} ' + str(float(counts.pod_writes)),
        }
        return text if all(line in text for line in said) else None

    text = wait_for(agreeing, what="the scrape and the operator's counts agreeing")
    assert counts.events >= 3, "this world's three Events at least"
    assert "gpuusage_operator_pod_index_size " in text
    assert "gpuusage_operator_active 1.0" in text
    assert "gpuusage_operator_reports " in text
    reconciles = next(
        line
        for line in text.splitlines()
        if line.startswith("gpuusage_operator_reconcile_duration_seconds_count")
    )
    assert float(reconciles.split()[-1]) >= 3, "every report event is timed"
    echoes = next(
        line
        for line in text.splitlines()
        if line.startswith("gpuusage_operator_echoes_skipped_total ")
    )
    assert float(echoes.split()[-1]) >= 1, "our own status writes came back and were skipped"


def test_stale_report_marks_pods_unknown(world: SimWorld) -> None:
    wait_for(lambda: condition(pod(world, "train")).status == "True", what="in use")
    world.agent.halt()  # the agent dies: no more reports
    unknown = wait_for(
        lambda: (c := condition(pod(world, "train"))).status == "Unknown" and c,
        timeout=30,
        what="Unknown",
    )
    assert unknown.reason == "NodeReportStale"
    assert names.ANNOTATION_GPUS in pod_annotations(world, "train"), "last use kept"

    def said() -> dict[str, str]:  # the status is written after the pods
        return {c["type"]: c["status"] for c in report(world)["status"]["conditions"]}

    wait_for(lambda: said() == {"Ready": "False", "Stale": "True"}, what="the report Stale")


def test_deleted_report_clears_its_pods(world: SimWorld) -> None:
    wait_for(lambda: condition(pod(world, "train")).status == "True", what="in use")
    world.agent.halt()  # otherwise the agent recreates its report
    client.CustomObjectsApi(world.api).delete_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, world.node
    )

    def cleared(name: str) -> bool:
        """No annotation and no condition of ours: no report, no marks."""
        ours = [c.type for c in conditions(pod(world, name)) if c.type != "Ready"]
        return names.ANNOTATION_GPUS not in pod_annotations(world, name) and ours == []

    wait_for(lambda: cleared("train") and cleared("notebook"), what="marks cleared")
    assert events(world, "train") == ["GPUUseStarted"], "nothing was observed to end"


def test_operator_restart_rebuilds_without_writes(world: SimWorld, cluster: LocalCluster) -> None:
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="in use")
    wait_for(lambda: condition(pod(world, "train")).status == "True", what="in use")
    world.stop_operator()

    # This world's pods as the first operator left them (the cluster is shared with other
    # tests' worlds, whose reports may go stale meanwhile: only these pods are compared).
    def version(name: str) -> str:
        meta = pod(world, name).metadata
        assert meta is not None
        return str(meta.resource_version)

    shown = {name: version(name) for name in ("train", "notebook")}
    told = {name: events(world, name) for name in shown}
    ready = threading.Event()
    settings = OperatorSettings(
        kubeconfig=cluster.kubeconfig, stale_after=30.0, resync=0.5, standalone=True
    )
    operator = Operator(settings)
    again = Background(lambda stop: operator.run(stop, ready))
    try:
        assert ready.wait(60)
        counts = operator.reconciler.counts
        wait_for(lambda: counts.reconciles >= 6, what="the initial listing and a few heartbeats")
        # the reconciles counted may be other worlds' reports (the cluster is shared): wait
        # for a status write, the sign that this operator reconciled reports with its clock
        wait_for(lambda: counts.status_writes > 0, what="the new operator's status writes")
        now = {name: version(name) for name in shown}
        assert now == shown, "what is right is left alone"
        assert {name: events(world, name) for name in shown} == told
    finally:
        again.halt()


def test_pod_deleted_while_its_process_is_still_reported(world: SimWorld) -> None:
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="in use")
    world.core.delete_namespaced_pod("notebook", world.ns, grace_period_seconds=0)

    def notebook_unattributed() -> bool:
        status = report(world)["status"]
        return any(
            u["pid"] == 5151 and u["reason"] == "PodNotFound" for u in status["unattributed"]
        )

    wait_for(notebook_unattributed, what="the deleted pod's process to be reported as PodNotFound")
    status = report(world)["status"]
    assert status["totals"]["pods"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    assert condition(pod(world, "train")).status == "True", "the other pod is unaffected"
    assert world.reconciler.counts.pod_errors == 0


def test_annotation_removed_by_someone_else_is_restored(world: SimWorld) -> None:
    """The last-applied cache must never mask what is really on the pod."""
    wait_for(lambda: names.ANNOTATION_GPUS in pod_annotations(world, "train"), what="annotations")
    before = pod_annotations(world, "train")
    patch = {"metadata": {"annotations": {names.ANNOTATION_GPUS: None}}}
    world.core.patch_namespaced_pod("train", world.ns, patch)
    restored = wait_for(
        lambda: (a := pod_annotations(world, "train")) and names.ANNOTATION_GPUS in a and a,
        what="the operator to restore its annotation on the next report",
    )
    assert restored[names.ANNOTATION_GPUS] == before[names.ANNOTATION_GPUS]
    assert world.reconciler.counts.pod_errors == 0


def test_requested_gpus_left_idle_are_flagged(make_world: WorldFactory) -> None:
    """A pod that never used its GPUs, and one whose use ended, both flagged after idle_after,
    each once (no flip-flop between reasons), and unflagged when use starts again."""
    world = make_world({"train": 1, "notebook": 1, "waiter": 2}, idle_after=3.0)

    def idle_names() -> list[str]:
        return [p["name"] for p in (report(world).get("status") or {}).get("idlePods", [])]

    def reason(name: str) -> str | None:
        found = [
            c for c in conditions(pod(world, name)) if c.type == names.POD_CONDITION_GPU_IN_USE
        ]
        return f"{found[0].status} {found[0].reason}" if found else None

    wait_for(lambda: idle_names() == ["waiter"], timeout=30, what="waiter flagged idle")
    assert reason("waiter") == "False RequestedGPUsIdle"
    waiter = condition(pod(world, "waiter"))
    pod_status = pod(world, "waiter").status
    assert pod_status is not None
    assert waiter.last_transition_time == pod_status.start_time, "idle since the pod started"
    assert "given 2 GPUs (device plugin)" in str(waiter.message)
    status = report(world)["status"]
    assert status["totals"]["idlePods"] == 1
    assert status["idlePods"][0]["requestedGPUs"] == 2
    assert wait_for(lambda: events(world, "waiter") == ["RequestedGPUsIdle"], what="event")
    assert reason("train") == "True ProcessesRunning", "pods in use are never idle"

    world.write(notebook=False)  # the notebook's use ends; it keeps its GPU
    wait_for(lambda: reason("notebook") == "False ProcessesEnded", what="use ended")
    wait_for(lambda: idle_names() == ["notebook", "waiter"], timeout=30, what="notebook idle")
    assert reason("notebook") == "False RequestedGPUsIdle"
    # The Event follows the condition write: wait for it before counting.
    flagged = ["GPUUseEnded", "GPUUseStarted", "RequestedGPUsIdle"]
    assert wait_for(lambda: events(world, "notebook") == flagged, what="idle event")
    counts = world.reconciler.counts
    before, looked = (counts.pod_writes, counts.events), counts.reconciles
    # Several reconciles (heartbeats, housekeeping): the idle pods stay flagged without a write.
    wait_for(lambda: counts.reconciles >= looked + 4, what="several reconciles")
    assert (counts.pod_writes, counts.events) == before
    assert events(world, "notebook") == flagged

    world.write(notebook=True)  # back at work: no longer idle
    wait_for(lambda: reason("notebook") == "True ProcessesRunning", what="notebook in use")
    wait_for(lambda: idle_names() == ["waiter"], what="notebook unflagged")
