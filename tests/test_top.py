"""`gpuusage top` and `kubectl gpuusage top` against the real apiserver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.announcement import Announcement, encode
from gpuusage_commands.toptable import (
    PodRow,
    allocation_text,
    allocations_by_node,
    namespace_allocation_text,
    namespace_rows,
    order,
    pending_text,
    pod_rows,
    read_statuses,
    render_namespace_table,
    render_table,
    select,
    with_pending,
)
from gpuusage_dev.localcluster.cluster import LocalCluster
from tests.builders import STATUS_TIME, status_pod, status_report
from tests.conftest import CHILD_ENV, gpuusage_cli

SUFFIX = uuid.uuid4().hex[:5]
NS_A, NS_B = f"ml-{SUFFIX}", f"web-{SUFFIX}"
NODE_1, NODE_2 = f"gpu-1-{SUFFIX}", f"gpu-2-{SUFFIX}"
BIG = status_pod(NS_A, "trainer", 61440, [1, 2], requested=2)
REPORTS = [
    status_report(
        NODE_1,
        {
            "GPU-aaa": [
                {**BIG, "computing": True},
                status_pod(NS_B, "embed", 2048, [3], requested=0),
            ],
            "GPU-bbb": [{**BIG, "usedMemoryMiB": 20480}],
        },
    ),
    status_report(NODE_2, {"MIG-ccc": [status_pod(NS_A, "notebook", 4096, [4])]}, stale=True),
    status_report(
        NODE_2 + "-b",
        {},
        idle=[
            {
                "namespace": NS_B,
                "name": "waiting",
                "requestedGPUs": 4,
                "uid": str(uuid.uuid4()),
                "idleSince": STATUS_TIME,
            }
        ],
    ),
]


def test_rows_merge_devices_sort_filter_and_mark_stale() -> None:
    rows, warnings = pod_rows(
        [
            *REPORTS,
            {"metadata": {"name": "bad"}, "status": {"pods": 1}},
            {"metadata": {"name": "new"}},
        ]
    )
    assert warnings == ["GpuNodeUsage bad: status unreadable (1 errors)"]
    ordered = order(rows)
    assert [(r.pod, r.memory_mib, len(r.devices), r.processes) for r in ordered] == [
        ("trainer", 81920, 2, 4),
        ("notebook", 4096, 1, 1),
        ("embed", 2048, 1, 1),
        ("waiting", 0, 0, 0),
    ]
    assert [r.pod for r in order(rows, "name")] == ["embed", "notebook", "trainer", "waiting"]
    assert [r.pod for r in select(ordered, NS_A, NODE_2)] == ["notebook"]
    table = render_table(ordered, all_namespaces=True).splitlines()
    assert table[0].split() == [
        "NAMESPACE",
        "NAME",
        "NODE",
        "GPUS",
        "ALLOCATED",
        "MEMORY",
        "COMPUTE",
        "PROCESSES",
        "DEVICES",
        "PENDING",
    ]
    assert table[1].split()[:6] == [NS_A, "trainer", NODE_1, "2", "2", "80Gi"]
    assert "4Gi (stale)" in table[2]
    assert table[3].split()[:6] == [NS_B, "embed", NODE_1, "1", "0", "(none!)"]
    assert table[4].split()[:8] == [
        NS_B,
        "waiting",
        NODE_2 + "-b",
        "0",
        "4",
        "(idle",
        "since",
        STATUS_TIME + ")",
    ]


def test_namespaces_sum_their_pods_use_against_what_they_were_handed() -> None:
    rows, _ = pod_rows(REPORTS)
    extra = [
        PodRow(
            "vision",
            "seg",
            "n9",
            ["GPU-x"],
            1024,
            allocated_by=["DRA"],
            allocated_devices=["GPU-x", "GPU-y"],
        ),
        PodRow("vision", "llm", "n9", ["GPU-x"], 512, allocated_by=["Fractional"]),
        PodRow(
            "vision",
            "lab",
            "n9",
            ["GPU-z"],
            8192,
            requested_gpus=1,
            allocated_by=["DevicePlugin"],
            held_idle=True,
            held_idle_since=STATUS_TIME,
        ),
        PodRow(
            "vision",
            "odd",
            "n9",
            ["GPU-z"],
            256,
            requested_gpus=1,
            allocated_by=["DevicePlugin"],
            allocated_devices=["GPU-w"],
            unallocated=True,
        ),
    ]
    summed = {r.namespace: r for r in namespace_rows([*rows, *extra])}
    a, b, v = summed[NS_A], summed[NS_B], summed["vision"]
    assert (a.pods, a.devices, a.memory_mib, a.allocated_gpus, a.stale) == (2, 3, 86016, 3, True)
    assert (b.pods, b.devices, b.allocated_gpus, b.idle_pods) == (1, 1, 4, 1), (
        "the idle pod holds its 4 GPUs"
    )
    assert (b.unrequested_pods, b.unallocated_pods) == (1, 0), "embed was handed no GPU at all"
    assert (v.pods, v.devices, v.allocated_gpus, v.shares, v.idle_pods) == (4, 2, 4, 1, 1), (
        "a device two pods share counts once; claims count their devices, a share is a share"
    )
    assert v.unallocated_pods == 1
    table = render_namespace_table(namespace_rows([*rows, *extra])).splitlines()
    assert table[0].split() == [
        "NAMESPACE",
        "PODS",
        "GPUS",
        "COMPUTING",
        "COMPUTE",
        "ALLOCATED",
        "MEMORY",
        "IDLE",
        "UNREQUESTED",
        "UNALLOCATED",
    ]
    assert a.computing == 1, "the trainer computes on one of its two GPUs"
    assert table[1].split() == [NS_A, "2", "3", "1", "-", "3", "84Gi", "(stale)", "0", "0", "0"]
    assert table[2].split() == [
        *["vision", "4", "2", "0", "-", "4", "+", "1", "share", "9.8Gi", "1", "0", "1"]
    ]


def test_unallocated_counts_only_pods_using_a_device_outside_what_they_were_handed() -> None:
    """UNALLOCATED is the reports' totals.unallocatedPods summed (UsingUnallocatedGPU): a pod
    that requested no GPU and uses one is UNREQUESTED (UsingUnrequestedGPU), not both."""
    report = status_report(
        "n-misuse",
        {
            "GPU-m1": [status_pod("lab", "notebook", 1024, [7], requested=0)],
            "GPU-m2": [
                {**status_pod("lab", "stray", 2048, [8], requested=1), "unallocated": True},
                status_pod("lab", "trainer", 4096, [9], requested=1),
            ],
        },
    )
    (lab,) = namespace_rows(pod_rows([report])[0])
    assert (lab.pods, lab.unrequested_pods, lab.unallocated_pods) == (3, 1, 1)
    table = render_namespace_table([lab]).splitlines()
    counts = dict(zip(table[0].split(), table[1].split(), strict=True))
    assert (counts["UNREQUESTED"], counts["UNALLOCATED"]) == ("1", "1")


def test_shares_of_gpu_time_add_up_per_pod_and_namespace() -> None:
    """A pod's shares of its devices' time add up as top adds CPU (150 % over two GPUs); a
    device that tells none is marked "+?" beside what the others tell; no device that tells
    one: "-". A namespace sums its pods'."""
    trainer = status_pod("share", "trainer", 1024, [1], requested=2)
    notebook = status_pod("share", "notebook", 512, [2], requested=1)
    mps = status_pod("share", "mps-client", 512, [3], requested=1)
    report = status_report(
        "n-share",
        {
            "GPU-s1": [{**trainer, "computeShare": 0.75}, {**notebook, "computeShare": 0.05}],
            "GPU-s2": [{**trainer, "computeShare": 0.75}, mps],
        },
    )
    rows = {r.pod: r for r in pod_rows([report])[0]}
    assert rows["trainer"].compute_share == 1.5
    assert rows["mps-client"].compute_share is None
    table = render_table(order(rows.values(), "name"), all_namespaces=False).splitlines()
    compute = table[0].split().index("COMPUTE")
    assert [line.split()[compute] for line in table[1:]] == ["-", "5%", "150%"]
    (ns,) = namespace_rows(rows.values())
    assert ns.compute_share is not None
    assert round(ns.compute_share, 3) == 1.55
    summed = render_namespace_table([ns]).splitlines()
    assert summed[1].split()[summed[0].split().index("COMPUTE")] == "155%+?"


def test_what_pods_were_handed_comes_from_the_reports_that_list_it() -> None:
    """A report whose operator lists status.allocations says what every running pod was
    handed (also one neither using nor idle yet); its pods' rows then add nothing to it."""
    listed = status_report(
        NODE_1 + "-h", {"GPU-ddd": [status_pod("team", "trainer", 1024, [9], requested=1)]}
    )
    uid = "33333333-2222-4333-8444-555555555555"
    listed["status"]["allocations"] = [
        {"namespace": "team", "name": "trainer", "uid": uid, "gpus": 1},
        {"namespace": "team", "name": "starting", "uid": uid, "gpus": 2},
        {"namespace": "team", "name": "slice", "uid": uid, "migDevices": 1},
        {"namespace": "team", "name": "llm", "uid": uid, "gpuShare": 0.5},
    ]
    rows, _ = pod_rows([listed])
    handed = allocations_by_node(read_statuses([listed, REPORTS[0]])[0])
    assert list(handed) == [NODE_1 + "-h"], "an earlier operator's report lists nothing"
    (team,) = namespace_rows(rows, handed)
    assert (team.pods, team.allocated_gpus, team.allocated_mig_devices) == (1, 3, 1)
    assert (team.shares, team.share_gpus) == (1, 0.5)
    assert namespace_allocation_text(team) == "3 + 1 MIG + 1 share (0.5 GPU)"


@pytest.mark.cluster
def test_top_and_the_kubectl_plugin_on_the_cluster(
    cluster: LocalCluster, api: client.ApiClient
) -> None:
    custom = client.CustomObjectsApi(api)
    for report in REPORTS:
        body = {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "metadata": report["metadata"],
            "spec": report["spec"],
        }
        custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, body)
        custom.patch_cluster_custom_object_status(
            names.GROUP,
            names.VERSION,
            names.PLURAL,
            report["metadata"]["name"],
            {"status": report["status"]},
        )
    kc = str(cluster.kubeconfig)

    def top(*args: str) -> str:
        shown = gpuusage_cli(cluster.kubeconfig, "top", *args)
        assert shown.returncode == 0, shown.stderr
        return shown.stdout

    lines = [line.split() for line in top("-A").splitlines()]
    ours = [line for line in lines[1:] if line[0] in (NS_A, NS_B)]
    assert [line[1] for line in ours] == ["trainer", "notebook", "embed", "waiting"], (
        "memory, largest first"
    )
    in_a = [x.split()[0] for x in top("-n", NS_A).splitlines()[1:]]  # no NAMESPACE column
    assert in_a == ["trainer", "notebook"]
    by_namespace = {
        i["namespace"]: i for i in json.loads(top("--by", "namespace", "-o", "json"))["items"]
    }
    assert (by_namespace[NS_A]["pods"], by_namespace[NS_A]["memory_mib"]) == (2, 86016)
    assert by_namespace[NS_B]["allocated_gpus"] == 4
    assert [line.split()[0] for line in top("--by", "namespace", "-n", NS_B).splitlines()] == [
        "NAMESPACE",
        NS_B,
    ]
    only = json.loads(top("-A", "--node", NODE_2, "-o", "json"))["items"]
    assert [(i["pod"], i["gpus"], i["requested_gpus"], i["stale"]) for i in only] == [
        ("notebook", 1, 1, True)
    ]
    # kubectl finds the plugin on PATH as kubectl-gpuusage, as users install it.
    plugin = Path(sys.executable).parent / "kubectl-gpuusage"
    assert plugin.exists(), "installed with the package (project.scripts)"
    env = {**CHILD_ENV, "PATH": f"{plugin.parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        [str(cluster.binaries.kubectl), "gpuusage", "top", "-n", NS_B, "--kubeconfig", kc],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    assert out.splitlines()[1].split()[:6] == ["embed", NODE_1, "1", "0", "(none!)", "2Gi"]


def test_the_allocation_column_says_what_each_pod_was_handed() -> None:
    g0, g1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-0000-0000-0000-000000000000"
    dra = {
        **status_pod(NS_A, "claimed", 10, [1], 0),
        "allocatedBy": ["DRA"],
        "allocatedDevices": [g0],
    }
    stray = {**dra, "name": "stray", "uid": str(uuid.uuid4()), "unallocated": True}
    share = {**status_pod(NS_A, "share", 10, [2], 0), "allocatedBy": ["Fractional"]}
    unknown = {**status_pod(NS_A, "waiting", 10, [3], 0), "unrequested": False}
    plugin = {**status_pod(NS_A, "plugin", 10, [4], 2), "allocatedBy": ["DevicePlugin"]}
    both = {
        **plugin,
        "name": "both",
        "uid": str(uuid.uuid4()),
        "allocatedBy": ["DevicePlugin", "Fractional"],
    }
    mixed = {
        **plugin,
        "name": "mixed",
        "uid": str(uuid.uuid4()),
        "allocatedBy": ["DevicePlugin", "DRA"],
        "allocatedDevices": [g0, g1],
        "unallocated": True,
    }
    rogue = status_pod(NS_A, "rogue", 10, [5], 0)
    report = status_report(
        "n1", {g0: [dra, share, unknown, plugin, both, rogue], g1: [stray, mixed]}
    )
    rows, _ = pod_rows([report])
    shown = {r.pod: allocation_text(r) for r in rows}
    assert shown == {
        "claimed": "dra:1",
        "stray": "dra:1 (outside!)",
        "share": "share",
        "waiting": "?",
        "plugin": "2",
        "both": "2+share",
        "mixed": "2+dra (outside!)",
        "rogue": "0 (none!)",
    }
    assert "dra:1 (outside!)" in render_table(rows, all_namespaces=False)


def test_the_allocation_column_counts_mig_slices_and_shares_as_what_they_are() -> None:
    """Where the operator lists status.allocations, a device plugin's count says which of its
    devices are MIG slices (NVIDIA's single MIG strategy hands them out as nvidia.com/gpu),
    and a share says how much of a GPU it is; as `--by namespace` counts them."""
    mig = "MIG-4f1d2c3b-5a6e-4d7c-8b9a-0f1e2d3c4b5a"
    g0 = "GPU-00000000-0000-0000-0000-000000000000"
    sliced = {**status_pod(NS_A, "sliced", 10, [1], 1), "allocatedBy": ["DevicePlugin"]}
    mixed = {**status_pod(NS_A, "mixed", 10, [2], 2), "allocatedBy": ["DevicePlugin"]}
    whole = {**status_pod(NS_A, "whole", 10, [3], 2), "allocatedBy": ["DevicePlugin"]}
    share = {**status_pod(NS_A, "share", 10, [4], 0), "allocatedBy": ["Fractional"]}
    vague = {**status_pod(NS_A, "vague", 10, [5], 0), "allocatedBy": ["Fractional"]}
    claimed = {
        **status_pod(NS_A, "claimed", 10, [6], 0),
        "allocatedBy": ["DRA"],
        "allocatedDevices": [mig],
    }
    report = status_report("n1", {mig: [sliced, claimed], g0: [mixed, whole, share, vague]})

    def entry(pod: dict[str, Any], **counts: Any) -> dict[str, Any]:
        return {"namespace": NS_A, "name": pod["name"], "uid": pod["uid"], **counts}

    report["status"]["allocations"] = [
        entry(sliced, migDevices=1),
        entry(mixed, gpus=1, migDevices=1),
        entry(whole, gpus=2),
        entry(share, gpuShare=0.5),
        entry(vague, gpuMemoryShareMiB=2048),
        entry(claimed, migDevices=1),
    ]
    rows, warnings = pod_rows([report])
    assert warnings == []
    shown = {r.pod: allocation_text(r) for r in rows}
    assert shown == {
        "sliced": "1 MIG",
        "mixed": "1+1 MIG",
        "whole": "2",
        "share": "share (0.5 GPU)",
        "vague": "share",
        "claimed": "dra:1",
    }
    before = status_report("n1", {mig: [sliced]})  # an earlier operator: no allocations listed
    assert [allocation_text(r) for r in pod_rows([before])[0]] == ["1"]


def test_a_pod_holding_memory_without_computing_is_marked() -> None:
    g0 = "GPU-00000000-0000-0000-0000-000000000000"
    kernel = {**status_pod(NS_A, "kernel", 71680, [7], 1), "heldIdleSince": STATUS_TIME}
    busy = status_pod(NS_A, "busy", 1024, [8], 1)
    rows, _ = pod_rows([status_report("n1", {g0: [kernel, busy]})])
    table = render_table(rows, all_namespaces=False)
    (line,) = [x for x in table.splitlines() if x.startswith("kernel")]
    assert "70Gi (held idle since " in line
    (other,) = [x for x in table.splitlines() if x.startswith("busy")]
    assert "held idle" not in other


def test_a_pending_policy_action_shows_from_the_pods_announcement() -> None:
    """The announcement as the operator writes it: the action and its due time (DryRun said),
    what came of it once taken or recorded; nothing for a pod without one or with a garbled
    one."""
    due = datetime(2026, 11, 25, 12, 30, tzinfo=UTC)
    pending = Announcement("reclaim", "HoldingIdleGPU", "ScaleToZero", "Enforce", "30m", due, due)
    rows = [PodRow(NS_A, "notebook", NODE_1, ["GPU-x"]), PodRow(NS_A, "trainer", NODE_1)]
    key = names.ANNOTATION_POLICY_ACTION
    with_pending(rows, {(NS_A, "notebook"): {key: encode(pending)}, (NS_A, "trainer"): {key: "{"}})
    assert [r.pending for r in rows] == ["ScaleToZero at 2026-11-25T12:30:00Z", ""]
    table = render_table(rows, all_namespaces=False).splitlines()
    assert table[0].split()[-1] == "PENDING"
    assert table[1].endswith("ScaleToZero at 2026-11-25T12:30:00Z")
    assert table[2].split()[-2:] == ["<none>", "<none>"]
    dry = replace(pending, mode="DryRun")
    assert pending_text(encode(dry)).endswith("(DryRun)")
    assert pending_text(encode(replace(dry, recorded=True))) == "ScaleToZero recorded (DryRun)"
    assert pending_text(encode(replace(pending, recorded=True))) == "ScaleToZero taken"
