"""`gpuusage ps`: every GPU process, from the reports' spec (what the agent saw) joined with their
status (whose pod it is, or why none). Pure rows first, then the command on the real control
plane with a real agent and operator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage.api.activity import process_activity
from gpuusage.api.models import Process
from gpuusage_commands.ps import PsSettings, scope
from gpuusage_commands.pstable import (
    order_processes,
    read_report,
    read_reports,
    render_processes,
    render_processes_json,
)
from gpuusage_commands.toptable import select
from gpuusage_dev.localcluster.cluster import LocalCluster
from tests.conftest import CHILD_ENV, GPU0, GPU1, WorldFactory, gpuusage_cli, wait_for
from tests.fakenvml import mig_uuid
from tests.worldview import report

WHEN = "2026-11-27T03:00:00Z"
MIG = mig_uuid(0)
POD_UID = "11111111-2222-3333-4444-555555555555"
NB_UID = "22222222-2222-3333-4444-555555555555"
SRV_UID = "33333333-2222-3333-4444-555555555555"


def _report(node: str = "gpu-a", *, stale: bool = False, status: bool = True) -> dict[str, Any]:
    """A node with a trainer (computing, 62 % of GPU 0), an idle notebook process beside it, a
    host Xorg, and a MIG device whose process's activity the driver does not tell."""
    gpus = [
        {
            "index": 0,
            "uuid": GPU0,
            "processes": [
                {"pid": 4242, "name": "python", "usedMemoryMiB": 30720, "computeShare": 0.62,
                 "computeShareSamples": 450, "computeShareSeconds": 299.5, "smUtilPercent": 90,
                 "containerID": "a" * 64, "podUID": POD_UID},
                {"pid": 5151, "name": "jupyter", "usedMemoryMiB": 10240, "computeShare": 0.0,
                 "idleSince": "2026-11-27T02:00:00Z"},
                {"pid": 777, "name": "Xorg", "usedMemoryMiB": 512},
            ],
            "omittedProcesses": 3,
        },
        {
            "index": 1,
            "uuid": GPU1,
            "migEnabled": True,
            "migDevices": [
                {"index": 1, "uuid": MIG,
                 "processes": [{"pid": 9000, "name": "infer", "usedMemoryMiB": 4096,
                                "activityUnknown": True}]},
            ],
        },
    ]  # fmt: skip
    conditions = [
        {"type": "Stale", "status": "True" if stale else "False", "reason": "Observed",
         "lastTransitionTime": WHEN},
    ]  # fmt: skip
    body: dict[str, Any] = {
        "metadata": {"name": node},
        "spec": {"nodeName": node, "observedAt": WHEN, "gpus": gpus},
    }
    if status:
        body["status"] = {
            "conditions": conditions,
            "pods": [
                {"namespace": "ml", "name": "trainer", "uid": POD_UID, "deviceUUID": GPU0,
                 "containers": [{"name": "main", "pids": [4242], "usedMemoryMiB": 30720}]},
                {"namespace": "lab", "name": "notebook", "uid": NB_UID, "deviceUUID": GPU0,
                 "containers": [{"name": "nb", "pids": [5151], "usedMemoryMiB": 10240}]},
                {"namespace": "ml", "name": "server", "uid": SRV_UID, "deviceUUID": MIG,
                 "containers": [{"name": "srv", "pids": [9000], "usedMemoryMiB": 4096}]},
            ],
            "unattributed": [
                {"pid": 777, "name": "Xorg", "deviceUUID": GPU0, "usedMemoryMiB": 512,
                 "reason": "HostProcess", "message": "not in a container"},
            ],
        }  # fmt: skip
    return body


def test_each_process_is_joined_with_its_pod_or_why_it_has_none() -> None:
    rows, notes, warning = read_report(_report())
    assert warning is None
    found = {r.pid: r for r in rows}
    assert set(found) == {4242, 5151, 777, 9000}
    trainer = found[4242]
    assert (trainer.node, trainer.device, trainer.command) == ("gpu-a", "0", "python")
    assert (trainer.namespace, trainer.pod, trainer.container) == ("ml", "trainer", "main")
    assert (trainer.memory_mib, trainer.compute_share, trainer.activity) == (
        30720,
        0.62,
        "computing",
    )
    assert (found[5151].activity, found[5151].idle_since) == ("idle", "2026-11-27T02:00:00Z")
    host = found[777]
    assert (host.pod, host.no_pod, host.no_pod_detail) == (
        None,
        "HostProcess",
        "not in a container",
    )
    mig = found[9000]
    assert (mig.device, mig.device_uuid, mig.activity) == ("1:1", MIG, "unknown")
    assert mig.compute_share is None
    assert [n.text for n in notes] == ["gpu-a: device 0: 3 more processes not listed"]


def test_a_stale_or_unresolved_report_says_so() -> None:
    rows, notes, _ = read_report(_report(stale=True))
    assert all(r.stale for r in rows)
    assert any("stale" in n.text for n in notes)
    rows, notes, _ = read_report(_report(status=False))
    assert {r.pid: r.pod for r in rows} == {4242: None, 5151: None, 777: None, 9000: None}
    assert any("not resolved these processes yet" in n.text for n in notes)
    assert "<pending>" in render_processes(rows, namespaces=True), "not the Unresolved reason"

    _, _, warnings = read_reports([{"metadata": {"name": "bad"}, "spec": {"gpus": "x"}}])
    assert [w.split(" (")[0] for w in warnings] == ["GpuNodeUsage bad: unreadable"]


def test_pids_past_the_status_list_and_reused_pids_go_by_the_agents_pod() -> None:
    """The status lists a container's first pids only: a further process of the pod is still
    its pod's (container unknown, `-`); a listed pid now in another pod (reused since the
    status was written) goes by the pod the agent attributed it to; a status behind the
    report says so."""
    body = _report()
    other = "99999999-2222-3333-4444-555555555555"
    body["spec"]["gpus"][0]["processes"] += [
        {"pid": 4243, "name": "python", "usedMemoryMiB": 1024, "podUID": POD_UID},
    ]
    body["spec"]["gpus"][0]["processes"][1]["podUID"] = other  # 5151, listed under POD_UID
    body["metadata"]["generation"] = 7
    body["status"]["observedGeneration"] = 6
    body["status"]["pods"].append(
        {"namespace": "new", "name": "reuser", "uid": other, "deviceUUID": GPU0,
         "containers": [{"name": "x", "pids": [], "usedMemoryMiB": 10240}]}
    )  # fmt: skip
    rows, notes, _ = read_report(body)
    found = {r.pid: r for r in rows}
    assert (found[4243].pod, found[4243].container) == ("trainer", None)
    assert (found[5151].namespace, found[5151].pod) == ("new", "reuser")
    table = render_processes(order_processes(rows, "pid"), namespaces=True).splitlines()
    assert table[3].split()[:7] == ["gpu-a", "0", "4243", "python", "ml", "trainer", "-"]
    assert any("from an earlier report" in n.text for n in notes)


def test_a_gpu_without_a_uuid_is_joined_by_the_name_the_status_gives_it() -> None:
    """A GPU that failed before its UUID was read: the operator names it gpu-index-<n>."""
    body = _report()
    body["spec"]["gpus"][0]["uuid"] = None
    for entry in body["status"]["pods"][:2] + body["status"]["unattributed"]:
        entry["deviceUUID"] = "gpu-index-0"
    rows, _, _ = read_report(body)
    found = {r.pid: r for r in rows}
    assert (found[4242].device, found[4242].device_uuid, found[4242].pod) == (
        "0",
        "gpu-index-0",
        "trainer",
    )
    assert found[777].no_pod == "HostProcess"


def test_processes_are_chosen_by_node_and_namespace_and_ordered() -> None:
    rows, _, _ = read_reports([_report("gpu-a"), _report("gpu-b")])
    assert len(select(rows, None, None)) == 8, "every process, those of no pod too"
    assert {r.pid for r in select(rows, "ml", None)} == {4242, 9000}
    assert {(r.node, r.pid) for r in select(rows, "lab", "gpu-b")} == {("gpu-b", 5151)}
    on_a = select(rows, None, "gpu-a")
    assert [r.pid for r in order_processes(on_a)] == [4242, 5151, 9000, 777], "memory first"
    assert [r.pid for r in order_processes(on_a, "share")] == [4242, 5151, 777, 9000]
    assert [r.pid for r in order_processes(on_a, "pid")] == [777, 4242, 5151, 9000]
    assert [r.pod for r in order_processes(on_a, "pod")] == ["notebook", "server", "trainer", None]


def test_the_table_wide_and_json() -> None:
    rows, notes, _ = read_report(_report())
    ordered = order_processes(rows)
    table = render_processes(ordered, namespaces=True).splitlines()
    assert table[0].split() == [
        "NODE", "GPU", "PID", "COMMAND", "NAMESPACE", "POD", "CONTAINER", "MEMORY", "SHARE",
        "ACTIVITY",
    ]  # fmt: skip
    assert table[1].split() == ["gpu-a", "0", "4242", "python", "ml", "trainer", "main", "30Gi",
                                "62%", "computing"]  # fmt: skip
    assert table[2].split()[-5:] == ["10Gi", "0%", "idle", "since", "2026-11-27T02:00:00Z"]
    assert table[4].split()[:7] == ["gpu-a", "0", "777", "Xorg", "<none>", "<HostProcess>",
                                    "<none>"]  # fmt: skip
    in_ns = render_processes(ordered[:1], namespaces=False).splitlines()
    assert "NAMESPACE" not in in_ns[0]
    wide = render_processes(ordered, namespaces=True, wide=True).splitlines()
    assert wide[0].split()[-5:] == ["DEVICE", "CONTAINER-ID", "SM", "SHARE-BASIS", "DETAIL"]
    assert wide[1].split()[-6:] == [GPU0, "a" * 13, "90%", "450", "samples/300s", "-"]
    assert "not in a container" in wide[4]
    parsed = json.loads(render_processes_json(ordered, notes))
    assert [i["pid"] for i in parsed["items"]] == [4242, 5151, 9000, 777]
    assert parsed["items"][3]["no_pod"] == "HostProcess"
    assert parsed["notes"] == [
        {"node": "gpu-a", "text": "gpu-a: device 0: 3 more processes not listed"}
    ]


def test_the_activity_rule_is_the_operators() -> None:
    """One rule for the operator's `computing` and the command's ACTIVITY column."""
    assert process_activity(Process(pid=1)) == "computing"
    assert process_activity(Process(pid=1, idle_since=WHEN)) == "idle"
    assert process_activity(Process(pid=1, activity_unknown=True, idle_since=WHEN)) == "unknown"


def test_the_scope_follows_kubectl(tmp_path: Path) -> None:
    """-A and a node without -n show every process; -n its namespace's pods; else the
    kubeconfig context's namespace, as kubectl uses it."""
    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ml"}},
                    {"name": "y", "context": {"cluster": "c", "user": "u", "namespace": "lab"}},
                ],
                "current-context": "x",
            }
        )
    )
    assert scope(PsSettings(all_namespaces=True, kubeconfig=config)) is None
    assert scope(PsSettings(node="gpu-a", kubeconfig=config)) is None
    assert scope(PsSettings(node="gpu-a", namespace="lab", kubeconfig=config)) == "lab"
    assert scope(PsSettings(kubeconfig=config)) == "ml"
    assert scope(PsSettings(kubeconfig=config, context="y")) == "lab", "--context's namespace"


@pytest.mark.cluster
def test_ps_and_the_kubectl_plugin_on_the_cluster(
    make_world: WorldFactory, cluster: LocalCluster
) -> None:
    """A real agent and operator: the trainer's and notebook's processes with their pods, the
    host's Xorg with its reason; an unknown node or namespace is an error that says so."""
    world = make_world()
    wait_for(lambda: report(world).get("status", {}).get("pods"), what="pods resolved")
    kc = str(cluster.kubeconfig)

    def ps(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        shown = gpuusage_cli(cluster.kubeconfig, "ps", *args)
        if check:
            shown.check_returncode()
        return shown

    def rows() -> dict[int, dict[str, Any]]:
        items = json.loads(ps("--node", world.node, "-o", "json").stdout)["items"]
        return {i["pid"]: i for i in items}

    wait_for(lambda: {4242, 5151, 777} <= rows().keys() and rows()[777]["no_pod"], what="rows")
    found = rows()
    assert (found[4242]["namespace"], found[4242]["pod"]) == (world.ns, "train")
    assert (found[5151]["namespace"], found[5151]["pod"]) == (world.ns, "notebook")
    assert found[777]["no_pod"] == "HostProcess"
    table = ps("-n", world.ns, "--node", world.node).stdout.splitlines()
    assert [line.split()[2] for line in table[1:]] == ["4242", "5151"], "memory first, no Xorg"
    assert "NAMESPACE" not in table[0]
    unknown = ps("--node", "no-such-node", check=False)
    assert unknown.returncode != 0
    assert "no GpuNodeUsage for node no-such-node" in unknown.stderr
    missing = ps("-n", "no-such-namespace", check=False)
    assert missing.returncode != 0
    assert "namespace no-such-namespace not found" in missing.stderr
    current = yaml.safe_load(cluster.kubeconfig.read_text())["current-context"]
    assert "4242" in ps("--node", world.node, "--context", current).stdout
    wrong = ps("--context", "no-such-context", check=False)
    assert wrong.returncode != 0
    assert "no-such-context" in wrong.stderr
    plugin = Path(sys.executable).parent / "kubectl-gpuusage"
    env = {**CHILD_ENV, "PATH": f"{plugin.parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        [str(cluster.binaries.kubectl), "gpuusage", "ps", "-A", "--kubeconfig", kc],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    assert any(line.split()[2:4] == ["777", "Xorg"] for line in out.splitlines()[1:])
