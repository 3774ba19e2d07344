"""`gpuusage top` and `ps` from the pods' own marks (for a user without the reports): the rows
each kind of mark makes, what a forged or shortened annotation makes, and the operator's own
usage annotation read back whole."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from gpuusage.api import names
from gpuusage.api.announcement import Announcement, encode
from gpuusage.api.models import Process
from gpuusage.api.usage import decode_usage
from gpuusage_commands.podmarks import (
    nothing_shown,
    order_marked,
    process_rows,
    render_marked,
    top_rows,
)
from gpuusage_commands.toptable import namespace_rows, order, render_table
from gpuusage_operator.judge.podstate import desired_annotations, usage_json
from gpuusage_operator.judge.resolution import pod_uses, resolve_all
from tests.builders import STATUS_TIME, api_pod, pod_lookup
from tests.examples import CTR_TRAIN, POD_TRAIN, example_spec

OBSERVED = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
NS = "lab"
G1, G2, G3 = (f"GPU-{i}1111111-2222-3333-4444-555555555555" for i in range(3))


def _use(container: str, *devices: tuple[str, int, list[int], float | None]) -> str:
    """A usage annotation of the operator's shape: one container on these devices."""
    slots = [
        {"uuid": uuid, "mib": mib, "pids": pids, **({"share": share} if share is not None else {})}
        for uuid, mib, pids, share in devices
    ]
    doc = {
        "node": "n1",
        "observedAt": STATUS_TIME,
        "containers": [{"name": container, "devices": slots}],
    }
    return json.dumps({**doc, "requestedGPUs": 1})


def _pod(
    name: str,
    *,
    status: str | None = None,
    reason: str | None = None,
    gpus: list[str] | None = None,
    mib: int = 0,
    usage: str | None = None,
    limits: dict[str, str] | None = None,
    claims: bool = False,
    more: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API lists it, carrying these marks."""
    annotations = dict(more or {})
    if gpus:
        annotations[names.ANNOTATION_GPUS] = ",".join(gpus)
        annotations[names.ANNOTATION_GPU_MEMORY_MIB] = str(mib)
    if usage is not None:
        annotations[names.ANNOTATION_USAGE] = usage
    conditions: list[dict[str, Any]] = [{"type": "Ready", "status": "True"}]
    if status is not None:
        conditions.append(
            {
                "type": names.POD_CONDITION_GPU_IN_USE,
                "status": status,
                "reason": reason,
                "message": "…",
                "lastTransitionTime": STATUS_TIME,
            }
        )
    spec: dict[str, Any] = {
        "nodeName": "n1",
        "containers": [{"name": "main", "resources": {"limits": limits or {"cpu": "1"}}}],
    }
    if claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]
    return {
        "metadata": {"namespace": NS, "name": name, "annotations": annotations},
        "spec": spec,
        "status": {"conditions": conditions},
    }


PENDING = Announcement(
    "reclaim", "HoldingIdleGPU", "ScaleToZero", "Enforce", "30m", OBSERVED, OBSERVED
)
PODS = [
    _pod(
        "train",
        status="True",
        reason="ProcessesRunning",
        gpus=[G1, G2],
        mib=3072,
        usage=_use("trainer", (G1, 2048, [41, 42], 0.5), (G2, 1024, [43], None)),
    ),
    _pod(
        "stray",
        status="True",
        reason="UsingUnallocatedGPU",
        gpus=[G2],
        mib=512,
        usage=_use("main", (G2, 512, [50], None)),
    ),
    _pod(
        "notebook",
        status="True",
        reason="UsingUnrequestedGPU",
        gpus=[G3],
        mib=256,
        usage=_use("jupyter", (G3, 256, [60], 0.25)).replace(
            '"requestedGPUs": 1', '"requestedGPUs": 0'
        ),
    ),
    _pod(
        "holder",
        status="True",
        reason="HoldingIdleGPU",
        gpus=[G3],
        mib=8192,
        usage=_use("main", (G3, 8192, [70], 0.0)),
        more={names.ANNOTATION_POLICY_ACTION: encode(PENDING)},
    ),
    _pod(
        "gone",
        status="Unknown",
        reason="NodeReportStale",
        gpus=[G1],
        mib=128,
        usage=_use("main", (G1, 128, [80], None)),
    ),
    _pod(
        "waiting",
        status="False",
        reason="RequestedGPUsIdle",
        limits={"nvidia.com/gpu": "4", "cpu": "2"},
    ),
    _pod(
        "claimed",
        status="True",
        reason="ProcessesRunning",
        gpus=[G2],
        mib=64,
        usage=_use("main", (G2, 64, [90], None)).replace(
            '"requestedGPUs": 1', '"requestedGPUs": 0'
        ),
        claims=True,
    ),
    _pod("ended", status="False", reason="ProcessesEnded"),
    _pod("plain"),
]


def _cells(table: str) -> dict[str, dict[str, str]]:
    """kubectl-style columns by the row's first cell and the header, each cell where its
    header starts."""
    header, *lines = table.splitlines()
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return {
        line.split()[0]: {header[a:b].strip(): line[a:b].strip() for a, b in bounds}
        for line in lines
    }


def test_top_shows_each_kind_of_mark_as_the_reports_view_shows_it() -> None:
    rows, warnings = top_rows(PODS)
    assert warnings == []
    cells = _cells(render_table(order(rows), all_namespaces=False))
    assert sorted(cells) == ["claimed", "gone", "holder", "notebook", "stray", "train", "waiting"]
    assert cells["train"]["ALLOCATED"] == "1"
    assert (cells["train"]["GPUS"], cells["train"]["PROCESSES"]) == ("2", "3")
    assert cells["train"]["COMPUTE"] == "50%+?", "one device tells no share"
    assert cells["stray"]["ALLOCATED"] == "1 (outside!)"
    assert cells["notebook"]["ALLOCATED"] == "0 (none!)"
    assert cells["holder"]["MEMORY"] == "8Gi (held idle)", "since when: only the reports know"
    assert cells["holder"]["PENDING"] == "ScaleToZero at 2026-11-21T12:00:00Z"
    assert cells["gone"]["MEMORY"] == "128Mi (stale)", "Unknown: the last known use"
    assert cells["waiting"]["ALLOCATED"] == f"4 (idle since {STATUS_TIME})"
    assert (cells["waiting"]["GPUS"], cells["waiting"]["DEVICES"]) == ("0", "<none>")
    assert cells["claimed"]["ALLOCATED"] == "dra:?", "what its claims got: only the reports"
    (lab,) = namespace_rows(rows)
    assert (lab.unrequested_pods, lab.unallocated_pods, lab.idle_pods) == (1, 1, 2)


def test_a_forged_or_shortened_usage_annotation_is_said_and_not_half_believed() -> None:
    forged = _pod("forged", status="True", reason="ProcessesRunning", gpus=[G1], mib=100)
    forged["metadata"]["annotations"][names.ANNOTATION_USAGE] = '{"containers": "all"}'
    shortened = _pod(
        "big",
        status="True",
        reason="ProcessesRunning",
        gpus=[G1],
        mib=4096,
        usage=json.dumps(
            {
                "node": "n1",
                "truncated": True,
                "containers": [{"name": "w0", "devices": [{"uuid": G1, "mib": 4096}]}],
            }
        ),
    )
    rows, warnings = top_rows([forged, shortened])
    assert warnings == [
        f"pod {NS}/forged: its {names.ANNOTATION_USAGE} annotation cannot be read",
        f"pod {NS}/big: its {names.ANNOTATION_USAGE} annotation was shortened: a part",
    ]
    by_pod = {r.pod: r for r in rows}
    assert (by_pod["forged"].devices, by_pod["forged"].memory_mib) == ([G1], 100)
    assert (by_pod["forged"].processes, by_pod["forged"].compute_share) == (0, None)
    processes, said = process_rows([forged, shortened])
    assert said == warnings
    assert [(r.pod, r.pids) for r in processes] == [("big", None)], "forged: no rows made up"
    assert render_marked(processes).splitlines()[1].split()[2] == "?"


def test_ps_shows_a_line_a_container_and_device() -> None:
    rows, warnings = process_rows(PODS)
    assert warnings == []
    ordered = order_marked(rows, "memory")
    assert [(r.pod, r.device_uuid, r.pids, r.memory_mib) for r in ordered[:3]] == [
        ("holder", G3, (70,), 8192),
        ("train", G1, (41, 42), 2048),
        ("train", G2, (43,), 1024),
    ]
    assert [r.pod for r in order_marked(rows, "pid")][:2] == ["train", "train"]
    assert [r.pod for r in order_marked(rows, "share")][:2] == ["train", "notebook"]
    table = render_marked(ordered).splitlines()
    assert table[0].split() == ["NODE", "DEVICE", "PIDS", "POD", "CONTAINER", "MEMORY", "SHARE"]
    assert table[2].split() == ["n1", G1, "41,42", "train", "trainer", "2Gi", "50%"]
    gone = next(line for line in table if " gone " in line)
    assert gone.startswith("n1 (stale)")


def test_a_namespace_whose_pods_carry_no_marks_is_not_said_to_use_no_gpus() -> None:
    """Observe first, or a namespace outside the operator's --namespace-selector: its pods use
    GPUs and carry none of gpuusage's marks. `top -n` and `ps -n` from the marks say that,
    and where the use shows; a pod a person annotated exempt carries no mark of the operator."""
    plain = [api_pod("train", "u-1", {"trainer": "c1"}, ns=NS)]
    plain[0]["metadata"]["annotations"] = {names.ANNOTATION_EXEMPT: "true"}
    said = nothing_shown(NS, plain, "No GPU processes", "")
    assert said == (
        "None of the pods in namespace lab carries gpuusage's marks: the operator may "
        "observe only (operator.podMarks=false), or lab may be outside its "
        "--namespace-selector. The reports (ClusterRole gpuusage-viewer) show the use."
    )
    assert nothing_shown(NS, PODS, "No GPU processes", " on node n9") == (
        "No GPU processes in namespace lab on node n9."
    ), "marked pods, none of them shown: none uses GPUs there"
    idle_cpu = [api_pod("web", "u-2", {"nginx": "c2"}, ns=NS, gpus=0)]
    assert nothing_shown(NS, idle_cpu, "No pods use GPUs", "") == (
        "No pods use GPUs in namespace lab."
    ), "no pod asks for a GPU: nothing to explain, marks or none"
    assert nothing_shown(NS, [], "No pods use GPUs", "") == "No pods use GPUs in namespace lab."
    ended = _pod("done", status="False", reason="ProcessesEnded")
    assert (
        nothing_shown(NS, [ended], "No pods use GPUs", "") == "No pods use GPUs in namespace lab."
    )


def test_the_operators_usage_annotation_reads_back_whole() -> None:
    """What judge.podstate writes, decode_usage reads: every field, and a shortened one as
    such; anything else is refused whole."""
    spec = example_spec("gpu-node-a", OBSERVED)
    pods = [api_pod("train-0", POD_TRAIN, {"trainer": CTR_TRAIN})]
    train = pod_uses("gpu-node-a", OBSERVED, resolve_all(spec, pod_lookup(*pods)))[POD_TRAIN]
    usage = decode_usage(desired_annotations(train)[names.ANNOTATION_USAGE])
    assert usage is not None
    assert (usage.node, usage.observed_at, usage.requested_gpus) == (
        "gpu-node-a",
        "2026-11-21T12:00:00Z",
        1,
    )
    ((container,),) = [usage.containers]
    assert container.name == "trainer"
    assert [(d.uuid, d.mib, d.pids) for d in container.devices] == [
        ("GPU-11111111-2222-3333-4444-555555555555", 30720, (4242,))
    ]
    assert usage.processes() == 1
    many = tuple(
        type(train.resolutions[0])(
            device_uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            process=Process(pid=1000 + i, used_memory_mib=10, compute_share=0.01),
            pod=train.pod,
            container_name=f"worker-{i:03d}",
        )
        for i in range(200)
    )
    shortened = decode_usage(usage_json(type(train)(train.pod, "n", OBSERVED, many), 2048))
    assert shortened is not None
    assert shortened.truncated
    assert shortened.processes() is None
    assert shortened.containers[0].devices[0].share == 0.01
    for forged in ("", "[]", "{", '{"containers": "x"}', '{"containers": [{"name": 1}]}'):
        assert decode_usage(forged) is None, forged
    no_pid = '{"containers": [{"name": "a", "devices": [{"uuid": "GPU-x", "pids": [0]}]}]}'
    assert decode_usage(no_pid) is None
