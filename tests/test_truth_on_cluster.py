"""What gpuusage writes on a pod stays true under hostile reports, races and faults.

Each test drives the real agent and operator against the real local control plane and checks
what a person would read on the pods afterwards.
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crds
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.proctree import pod_cgroup, write_process
from gpuusage_dev.simulation import Background, create_running_pod, ensure_namespace
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.informers.podwatch import PodWatch
from gpuusage_operator.main import run_operator
from gpuusage_operator.settings import OperatorSettings
from tests.builders import reconciler_on
from tests.conftest import GPU0, GPU1, WorldFactory, wait_for
from tests.simworld import SimWorld
from tests.worldview import (
    Place,
    View,
    condition,
    conditions,
    events,
    pod,
    pod_annotations,
    report,
    scrape,
)

pytestmark = pytest.mark.cluster


def container_id(world: SimWorld, name: str) -> str:
    status = pod(world, name).status
    assert status is not None
    assert status.container_statuses
    return str(status.container_statuses[0].container_id).split("://", 1)[1]


def in_use(world: View, name: str) -> bool:
    return bool(condition(pod(world, name)).status == "True")


def unattributed(world: View, node: str) -> dict[int, str]:
    status = report(world, node).get("status") or {}
    return {u["pid"]: u["reason"] for u in status.get("unattributed") or []}


def stale(world: View, node: str) -> bool:
    found = (report(world, node).get("status") or {}).get("conditions") or []
    return any(c["type"] == names.CONDITION_STALE and c["status"] == "True" for c in found)


def test_reports_never_mark_pods_of_other_nodes(
    make_world: WorldFactory, cluster: LocalCluster, tmp_path: Path
) -> None:
    """Node B's agent, and a report named after no Node at all, name a pod of node A by its
    container ID and by its UID: A's pod keeps exactly its own marks, and stays True when those
    reports go stale."""
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    wait_for(lambda: events(world, "train") == ["GPUUseStarted"], what="start Event")
    before = pod_annotations(world, "train")
    cid, uid = container_id(world, "train"), world.uids["train"]

    node_b = f"gpu-{uuid.uuid4().hex[:6]}"
    world.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node_b)))
    proc = tmp_path / "proc-b"
    write_process(proc, 9001, pod_cgroup(uid, cid))
    write_process(proc, 9002, f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice\n")
    scenario = tmp_path / "scenario-b.yaml"
    scenario.write_text(
        yaml.safe_dump(
            {
                "gpus": [
                    {
                        "index": 0,
                        "uuid": GPU1,
                        "memoryTotalMiB": 81920,
                        "processes": [
                            {"pid": 9001, "usedMemoryMiB": 5000},
                            {"pid": 9002, "usedMemoryMiB": 7},
                        ],
                    }
                ]
            }
        )
    )
    agent_b = Background(
        lambda stop: run_agent(
            AgentSettings(
                node_name=node_b,
                interval=0.3,
                heartbeat=1.0,
                gpu_source=f"fake:{scenario}",
                proc_root=proc,
                kubeconfig=cluster.kubeconfig,
                metrics_port=0,
            ),
            stop,
        )
    )
    ghost = f"no-such-node-{uuid.uuid4().hex[:6]}"
    client.CustomObjectsApi(world.api).create_cluster_custom_object(
        names.GROUP,
        names.VERSION,
        names.PLURAL,
        {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "metadata": {"name": ghost},
            "spec": {
                "nodeName": ghost,
                "observedAt": format_time(datetime.now(UTC)),
                "gpus": [
                    {
                        "index": 0,
                        "uuid": GPU0,
                        "memory": {"totalMiB": 81920},
                        "processes": [{"pid": 31, "usedMemoryMiB": 100, "containerID": cid}],
                    }
                ],
            },
        },
    )
    try:
        wait_for(
            lambda: unattributed(world, node_b) == {9001: "PodOnOtherNode", 9002: "PodOnOtherNode"},
            what="node B's processes said to be on another node",
        )
        wait_for(
            lambda: unattributed(world, ghost) == {31: "PodOnOtherNode"},
            what="the ghost report's process said to be on another node",
        )
        status_b = report(world, node_b)["status"]
        assert status_b["pods"] == []
        assert status_b["totals"]["pods"] == 0
        text = scrape(world.metrics_port)
        assert 'gpuusage_operator_unattributed_processes{reason="PodOnOtherNode"} 3.0' in text
        assert pod_annotations(world, "train") == before
        agent_b.halt()
        wait_for(
            lambda: stale(world, node_b) and stale(world, ghost),
            timeout=30,
            what="both foreign reports stale",
        )
        found = condition(pod(world, "train"))
        assert (found.status, found.reason) == ("True", "ProcessesRunning")
        assert pod_annotations(world, "train") == before
        assert events(world, "train") == ["GPUUseStarted"]
    finally:
        agent_b.halt()
        client.CustomObjectsApi(world.api).delete_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, ghost
        )


def test_a_pod_recreated_under_the_same_name_never_gets_its_predecessors_marks(
    make_world: WorldFactory, api: client.ApiClient
) -> None:
    """The index still shows train-0's predecessor (the watch lagged): the write carries the
    old UID, the apiserver refuses it, the index reads the pod again, and the new pod stays
    unmarked while the other pod of the report is marked as usual."""
    world = make_world(operator=False)
    wait_for(lambda: report(world).get("spec"), what="the agent's report")
    core = world.core
    watch = PodWatch(client.CoreV1Api(api))
    watch.list_all()  # the index as it stood before the pod was replaced
    old_uid = world.uids["train"]
    core.delete_namespaced_pod("train", world.ns, grace_period_seconds=0)
    new_uid, _ = create_running_pod(core, world.ns, "train", world.node, "trainer")
    reread: list[str] = []

    def refresh(namespace: str, name: str, stale_uid: str) -> None:
        reread.append(name)
        watch.refresh(namespace, name, stale_uid)

    reconciler = reconciler_on(api, refresh=refresh)
    reconciler.reconcile(report(world), watch.lookup(), datetime.now(UTC))

    assert reconciler.counts.uid_refusals == 1
    assert reconciler.counts.pod_errors == 0
    assert not any(k.startswith(names.GROUP) for k in pod_annotations(world, "train"))
    assert [c.type for c in conditions(pod(world, "train"))] == ["Ready"]
    assert events(world, "train") == []
    assert reread == ["train"], "the one pod read again"
    refreshed = watch.lookup().by_uid(new_uid)
    assert refreshed is not None
    assert refreshed.name == "train"
    assert watch.lookup().by_uid(old_uid) is None
    assert in_use(world, "notebook"), "the rest of the report was applied"
    # The next reconcile resolves against the refreshed index: the report's process names the
    # old pod, which is gone, so nothing is written and nothing is refused.
    reconciler.reconcile(report(world), watch.lookup(), datetime.now(UTC))
    assert reconciler.counts.uid_refusals == 1
    assert unattributed(world, world.node).get(world.pids["train"]) == "PodNotFound"


def _stale_condition(world: SimWorld) -> dict[str, Any]:
    found = report(world)["status"]["conditions"]
    return next(c for c in found if c["type"] == names.CONDITION_STALE)


def test_a_report_dated_in_the_future_goes_stale_when_it_stops_changing(
    make_world: WorldFactory,
) -> None:
    """observedAt in the year 2100 is the node's clock: the operator judges freshness by when
    it saw the report change, says the clock is off, and marks the pods Unknown once the
    report stops changing."""
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    world.agent.halt()  # from now on the report changes only when the test writes it
    custom = client.CustomObjectsApi(world.api)

    def reconciled() -> bool:
        got = report(world)
        return bool(got["status"].get("observedGeneration") == got["metadata"]["generation"])

    for second in (0, 1):  # two changes, so the operator sees one happen and measures the skew
        when = {"spec": {"observedAt": f"2100-01-01T00:00:0{second}Z"}}
        custom.patch_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, world.node, when
        )
        wait_for(reconciled, what="the change reconciled")
    fresh = wait_for(
        lambda: (c := _stale_condition(world)) and "clock is about" in c["message"] and c,
        what="the skew said",
    )
    assert fresh["status"] == "False"
    assert "ahead of the operator's" in fresh["message"]
    series = f'gpuusage_operator_report_clock_skew_seconds{{node="{world.node}"}}'
    skew = next(line for line in scrape(world.metrics_port).splitlines() if line.startswith(series))
    assert float(skew.split()[-1]) > 60 * 60 * 24 * 365 * 70
    stale = wait_for(
        lambda: (c := _stale_condition(world))["status"] == "True" and c,
        timeout=30,
        what="the report stale although dated in the future",
    )
    assert "by the operator's clock" in stale["message"]
    unknown = wait_for(
        lambda: (c := condition(pod(world, "train"))).status == "Unknown" and c,
        timeout=30,
        what="train Unknown",
    )
    assert unknown.reason == "NodeReportStale"
    seen = report(world)["status"]["reportSeenAt"]
    assert seen.startswith(str(datetime.now(UTC).year)), "reportSeenAt is the operator's clock"


def _process(world: SimWorld, pid: int) -> dict[str, Any]:
    gpus = report(world)["spec"]["gpus"]
    return next(p for g in gpus for p in g["processes"] if p["pid"] == pid)


def test_a_process_whose_proc_files_cannot_be_read_has_not_ended(
    make_world: WorldFactory,
) -> None:
    """/proc/<pid> hidden (hidepid, a lost hostPID): the pod keeps its use for the grace
    period, then its condition turns Unknown with the reason, never False, and no Event pair."""
    world = make_world(attribution_grace=3.0)
    pid = world.pids["train"]
    wait_for(lambda: in_use(world, "train"), what="train in use")
    wait_for(lambda: events(world, "train") == ["GPUUseStarted"], what="start Event")
    marks = pod_annotations(world, "train")
    hidden = world.proc / f".hidden-{pid}"
    (world.proc / str(pid)).rename(hidden)
    carried = wait_for(
        lambda: (p := _process(world, pid)).get("resolveError") and p,
        what="the agent says it cannot read the process",
    )
    assert carried["podUID"] == world.uids["train"], "the last attribution is kept"
    assert "showing the attribution last read" in carried["resolveError"]
    found = condition(pod(world, "train"))
    assert (found.status, found.reason) == ("True", "ProcessesRunning")
    unknown = wait_for(
        lambda: (c := condition(pod(world, "train"))).status != "True" and c,
        timeout=30,
        what="the grace period to end",
    )
    assert (unknown.status, unknown.reason) == ("Unknown", "ProcessesUnresolved")
    assert f"process {pid}" in str(unknown.message)
    assert pod_annotations(world, "train") == marks, "last known use kept"
    wait_for(
        lambda: unattributed(world, world.node).get(pid) == "Unresolved",
        what="the status, written after the pods",
    )
    hidden.rename(world.proc / str(pid))
    wait_for(lambda: in_use(world, "train"), what="train in use again")
    assert events(world, "train") == ["GPUUseStarted"], "no GPUUseEnded/GPUUseStarted pair"
    assert in_use(world, "notebook"), "the other pod was never affected"


def test_a_deleted_pod_leaves_the_status_without_waiting_for_the_report(
    make_world: WorldFactory,
) -> None:
    """The agent is gone (its report sends no event); a pod the status lists is deleted: the
    status stops naming it at once, long before the report would go stale."""
    world = make_world(stale_after=60.0)
    wait_for(lambda: in_use(world, "notebook"), what="notebook in use")
    world.agent.halt()

    def listed() -> set[str]:
        return {p["name"] for p in report(world)["status"]["pods"]}

    wait_for(lambda: listed() == {"train", "notebook"}, what="both pods in the status")
    world.core.delete_namespaced_pod("notebook", world.ns, grace_period_seconds=0)
    wait_for(lambda: listed() == {"train"}, timeout=20, what="the deleted pod dropped")
    assert unattributed(world, world.node)[world.pids["notebook"]] == "PodNotFound"
    assert not stale(world, world.node), "not the staleness reconcile: the deletion's"


def test_marks_of_a_report_deleted_while_no_operator_ran_are_cleared(
    make_world: WorldFactory, cluster: LocalCluster
) -> None:
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    world.stop_operator()
    world.agent.halt()
    client.CustomObjectsApi(world.api).delete_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, world.node
    )
    assert in_use(world, "train"), "nobody has cleared it yet"
    settings = OperatorSettings(
        kubeconfig=cluster.kubeconfig, stale_after=4.0, resync=0.5, standalone=True
    )
    ready = threading.Event()
    again = Background(lambda stop: run_operator(settings, stop, ready))
    try:
        assert ready.wait(60)

        def unmarked(name: str) -> bool:
            ours = [c.type for c in conditions(pod(world, name)) if c.type != "Ready"]
            return ours == [] and not any(
                k.startswith(names.GROUP) for k in pod_annotations(world, name)
            )

        wait_for(
            lambda: unmarked("train") and unmarked("notebook"),
            timeout=30,
            what="the orphaned marks cleared",
        )
    finally:
        again.halt()


def _metric(world: SimWorld, name: str) -> float:
    line = next(x for x in scrape(world.metrics_port).splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_an_etcd_outage_is_logged_once_and_its_end_once(
    make_world: WorldFactory, cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    caplog.set_level(logging.WARNING, logger="gpuusage_operator.informers.apihealth")
    cluster.stop("etcd")
    try:
        wait_for(
            lambda: any("API unavailable" in r.getMessage() for r in caplog.records),
            timeout=30,
            what="the outage logged",
        )
        wait_for(
            lambda: _metric(world, "gpuusage_operator_api_failed_calls_total") >= 3,
            timeout=30,
            what="several failed calls during the outage",
        )
        assert _metric(world, "gpuusage_operator_api_available") == 0
    finally:
        cluster.start("etcd")
    wait_for(
        lambda: any("available again after" in r.getMessage() for r in caplog.records),
        timeout=30,
        what="the recovery logged",
    )
    said = [
        r.getMessage().split(" (")[0].split(" after")[0]
        for r in caplog.records
        if r.name == "gpuusage_operator.informers.apihealth"
    ]
    assert said == ["Kubernetes API unavailable", "Kubernetes API available again"]
    assert _metric(world, "gpuusage_operator_api_available") == 1
    wait_for(lambda: in_use(world, "train"), what="train still in use after the outage")


def test_an_invalid_scenario_edit_loses_nothing(make_world: WorldFactory) -> None:
    """An emptied scenario file used to read as "no GPUs" and end every pod's use: it is an
    invalid edit, said in the report, and the pods keep their marks."""
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    wait_for(lambda: events(world, "train") == ["GPUUseStarted"], what="the start Event")
    world.scenario_file.write_bytes(b"")
    said = wait_for(
        lambda: "is empty" in (m := report(world)["spec"]["source"].get("message") or "") and m,
        what="the invalid edit said",
    )
    assert "showing the last valid scenario" in said
    assert in_use(world, "train")
    assert in_use(world, "notebook")
    assert events(world, "train") == ["GPUUseStarted"], "no end Event"


def test_a_node_with_more_processes_than_a_report_holds_stays_fresh(
    make_world: WorldFactory,
) -> None:
    """600 processes on one GPU: the agent's report lists the 512 largest and counts the rest,
    the apiserver stores it, and the node stays fresh (it used to be refused on every write)."""
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    many = [{"pid": 100_000 + i, "usedMemoryMiB": i} for i in range(600)]
    world.scenario([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": many}])

    def capped() -> dict[str, Any] | None:
        gpu = report(world)["spec"]["gpus"][0]
        return gpu if gpu.get("omittedProcesses") else None

    gpu = wait_for(capped, what="the capped report stored")
    assert len(gpu["processes"]) == 512
    assert gpu["omittedProcesses"] == 88
    assert gpu["omittedMemoryMiB"] == sum(range(88)), "the smallest were left out"
    assert not stale(world, world.node)
    device = wait_for(
        lambda: next(d for d in report(world)["status"]["devices"] if d.get("omittedProcesses")),
        what="the status",
    )
    assert device["omittedProcesses"] == 88


def test_a_report_etcd_refuses_is_published_without_processes(tmp_path: Path) -> None:
    """etcd refuses requests over its --max-request-bytes ("request is too large", a 500 from
    the apiserver). Here its limit is 64 KiB, so a report of 300 processes is too large: the
    agent sends it once, then publishes the observation without processes, the refusal said in
    spec.source and on each device; the operator then marks the pod Unknown, not ended."""
    small = LocalCluster(
        tmp_path / "small-etcd", tie_to_parent=True, etcd_args=["--max-request-bytes=65536"]
    )
    small.up()
    try:
        api, _ = api_client(small.kubeconfig)
        with api:
            install_crds(api)
            core = client.CoreV1Api(api)
            ensure_namespace(core, "ml")
            core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="busy")))
            uid, cid = create_running_pod(core, "ml", "train", "busy", "trainer")
            proc = tmp_path / "proc"
            write_process(proc, 4242, pod_cgroup(uid, cid))
            scenario = tmp_path / "gpus.yaml"

            def gpus(extra: int) -> None:
                procs: list[dict[str, Any]] = [{"pid": 4242, "usedMemoryMiB": 30000}]
                procs += [
                    {"pid": 50_000 + i, "usedMemoryMiB": 1, "name": "x" * 60} for i in range(extra)
                ]
                fresh = scenario.with_suffix(".new")
                fresh.write_text(
                    yaml.safe_dump(
                        {
                            "gpus": [
                                {
                                    "index": 0,
                                    "uuid": GPU0,
                                    "memoryTotalMiB": 81920,
                                    "processes": procs,
                                }
                            ]
                        }
                    )
                )
                fresh.replace(scenario)

            gpus(0)
            agent = Background(
                lambda stop: run_agent(
                    AgentSettings(
                        node_name="busy",
                        interval=0.3,
                        heartbeat=1.0,
                        gpu_source=f"fake:{scenario}",
                        proc_root=proc,
                        kubeconfig=small.kubeconfig,
                        metrics_port=0,
                    ),
                    stop,
                )
            )
            ready = threading.Event()
            operator = Background(
                lambda stop: run_operator(
                    OperatorSettings(
                        kubeconfig=small.kubeconfig, stale_after=30.0, resync=0.5, standalone=True
                    ),
                    stop,
                    ready,
                )
            )
            world = Place(api, core, "ml", "busy")
            try:
                assert ready.wait(60)
                wait_for(lambda: in_use(world, "train"), what="train in use")
                gpus(300)  # about 100 kB of report: over etcd's 64 KiB
                spec = wait_for(
                    lambda: (s := report(world)["spec"])["source"].get("message") and s,
                    what="the refusal published",
                )
                assert "the API refused this node's full report" in spec["source"]["message"]
                assert "request is too large" in spec["source"]["message"]
                assert "processes" not in spec["gpus"][0], "none: the empty list is left out"
                assert spec["gpus"][0]["error"]["reason"] == "ReportRefused"
                unknown = wait_for(
                    lambda: (c := condition(pod(world, "train"))).status == "Unknown" and c,
                    what="train Unknown",
                )
                assert unknown.reason == "DeviceNotReadable"
                assert not stale(world, "busy"), "the node keeps reporting"
                gpus(0)  # the observation changes: the full report goes through again
                wait_for(lambda: in_use(world, "train"), what="train in use again")
            finally:
                agent.halt()
                operator.halt()
    finally:
        small.down()


def _restart_container(world: SimWorld, name: str, *, running: bool) -> str:
    """The pod's status as the kubelet writes it once the container exited: restarted under a
    new container ID (running), or waiting to be (CrashLoopBackOff); the new ID."""
    status = pod(world, name).status
    assert status is not None
    assert status.container_statuses
    old = status.container_statuses[0]
    new_id = uuid.uuid4().hex + uuid.uuid4().hex
    exited = {"terminated": {"exitCode": 1, "finishedAt": format_time(datetime.now(UTC))}}
    entry = {
        "name": old.name,
        "ready": running,
        "restartCount": 1,
        "image": old.image,
        "imageID": old.image_id,
        "lastState": exited,
        **(
            {"containerID": f"containerd://{new_id}", "state": {"running": {}}}
            if running
            else {"state": {"waiting": {"reason": "CrashLoopBackOff"}}}
        ),
    }
    world.core.patch_namespaced_pod_status(
        name, world.ns, {"status": {"containerStatuses": [entry]}}
    )
    return new_id


def test_a_container_restart_is_continuous_use(make_world: WorldFactory) -> None:
    """The kubelet restarts train's container: its process leaves the GPU, a new one under
    the new container ID arrives on it. The pod's condition never changes (same transition
    time), no Event says its use ended and started again; the new process is the pod's."""
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    wait_for(lambda: events(world, "train") == ["GPUUseStarted"], what="start Event")
    before = condition(pod(world, "train"))
    world.scenario(
        [{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []}]
    )  # the process exited: the driver lists it no more
    wait_for(lambda: not report(world)["spec"]["gpus"][0].get("processes"), what="gone")
    new_id = _restart_container(world, "train", running=True)
    write_process(world.proc, 4343, pod_cgroup(world.uids["train"], new_id), start_ticks=4343)
    world.scenario(
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [{"pid": 4343, "usedMemoryMiB": 30720}],
            }
        ]
    )
    wait_for(
        lambda: _process(world, 4343).get("podUID") == world.uids["train"], what="the new process"
    )
    assert _process(world, 4343)["containerID"] == new_id
    # (the status has every pid at once; the pod's detail follows at its own pace)
    wait_for(
        lambda: (
            [
                c["pids"]
                for p in report(world)["status"]["pods"]
                if p["uid"] == world.uids["train"]
                for c in p["containers"]
            ]
            == [[4343]]
        ),
        what="the status naming the new pid",
    )
    assert condition(pod(world, "train")) == before
    assert events(world, "train") == ["GPUUseStarted"]


def test_a_container_that_does_not_come_back_ends_its_use_after_the_grace(
    make_world: WorldFactory,
) -> None:
    """train's container exits and the kubelet backs off before restarting it: the pod is
    Unknown (ContainerRestarted) with its last use kept, without an Event; when the grace is
    over with no process back, its use ended. (Unknown lasts from the marks' settling, 5 s
    after the exit, to the grace's end: 15 s leaves a loaded machine time to see it.)"""
    world = make_world(operator_extras={"restart_grace": 15.0})
    wait_for(lambda: in_use(world, "train"), what="train in use")
    marks = pod_annotations(world, "train")
    _restart_container(world, "train", running=False)
    world.scenario([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []}])
    unknown = wait_for(
        lambda: (c := condition(pod(world, "train"))).status == "Unknown" and c,
        timeout=30,
        what="train Unknown while restarting",
    )
    assert unknown.reason == "ContainerRestarted"
    assert "container trainer exited at" in str(unknown.message)
    assert pod_annotations(world, "train") == marks
    assert events(world, "train") == ["GPUUseStarted"]
    ended = wait_for(
        lambda: (c := condition(pod(world, "train"))).status == "False" and c,
        timeout=30,
        what="use ended once the grace is over",
    )
    assert ended.reason == "ProcessesEnded"
    # The Event follows the condition's write: wait for it, then hold it to be the only pair.
    wait_for(
        lambda: events(world, "train") == ["GPUUseEnded", "GPUUseStarted"],  # sorted
        what="the end Event after the condition",
    )


def test_a_process_that_ends_while_its_container_runs_on_ends_its_use(
    make_world: WorldFactory,
) -> None:
    """No restart: the process left the GPU, its container runs on. Once the marks settled
    (the kubelet had time to report an exit, and reported none), the use ended."""
    world = make_world()
    wait_for(lambda: in_use(world, "train"), what="train in use")
    world.scenario([{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []}])
    gone = wait_for(lambda: not report(world)["spec"]["gpus"][0].get("processes"), what="gone")
    assert gone
    assert in_use(world, "train"), "the marks settle first"
    ended = wait_for(
        lambda: (c := condition(pod(world, "train"))).status == "False" and c,
        timeout=30,
        what="use ended",
    )
    assert ended.reason == "ProcessesEnded"
    # The Event follows the condition's write: wait for it, then hold it to be the only pair.
    wait_for(
        lambda: events(world, "train") == ["GPUUseEnded", "GPUUseStarted"],  # sorted
        what="the end Event after the condition",
    )


def test_a_pod_that_people_annotated_exempt_is_not_marked(make_world: WorldFactory) -> None:
    """gpuusage.io/exempt is a people's annotation of our group (policies leave such a pod
    alone): it marks nothing, so the operator never 'unmarks' the pod with a condition it
    never had."""
    exempt = {"annotations": {names.ANNOTATION_EXEMPT: "true"}}
    world = make_world({"train": 1, "quiet": 0}, pod_extras={"quiet": exempt})
    wait_for(lambda: in_use(world, "train"), what="train in use")
    wait_for(
        lambda: report(world, world.node).get("status", {}).get("observedGeneration"),
        what="the report reconciled",
    )
    assert [c.type for c in conditions(pod(world, "quiet"))] == ["Ready"]
    assert pod_annotations(world, "quiet") == {names.ANNOTATION_EXEMPT: "true"}
