"""The findings as OpenReports results (pure): what each finding publishes, which policy covers
it, the timestamps a steady finding keeps, the bound and the count of what it leaves out."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuusage.api import names
from gpuusage.api.announcement import Announcement, encode
from gpuusage.api.models import OrphanedMemory
from gpuusage.api.policy import NodeRule
from gpuusage.api.times import format_time
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.openreports.results import (
    MAX_RESULTS,
    NodeFacts,
    kept_results,
    namespace_results,
    node_results,
    pod_result,
    report_content,
    stamped,
)

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
ETCD_LIMIT = 1_572_864
"""etcd's default limit on one object's size (--max-request-bytes, 1.5 MiB)."""


def _pod(
    status: str,
    reason: str,
    *,
    name: str = "train",
    namespace: str = "ml",
    announcement: Announcement | None = None,
    message: str = "1 process on node gpu-a uses GPU-0",
    since: datetime = NOW - timedelta(hours=1),
    node: str = "gpu-a",
    gpus: str = "GPU-0",
) -> PodSnapshot:
    condition = {
        "type": names.POD_CONDITION_GPU_IN_USE,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": format_time(since),
    }
    annotations = {names.ANNOTATION_GPUS: gpus}
    if announcement is not None:
        annotations[names.ANNOTATION_POLICY_ACTION] = encode(announcement)
    return PodSnapshot(
        namespace=namespace,
        name=name,
        uid=f"uid-{namespace}-{name}",
        node=node,
        annotations=tuple(sorted(annotations.items())),
        condition=tuple(sorted(condition.items())),
    )


@pytest.mark.parametrize(
    ("status", "reason", "result", "severity"),
    [
        ("True", "UsingUnrequestedGPU", "fail", "high"),
        ("True", "UsingUnallocatedGPU", "fail", "high"),
        ("True", "HoldingIdleGPU", "warn", "medium"),
        ("False", "RequestedGPUsIdle", "warn", "medium"),
    ],
)
def test_each_pod_finding_is_one_result_about_its_pod(
    status: str, reason: str, result: str, severity: str
) -> None:
    found = pod_result(_pod(status, reason))
    assert found is not None
    assert (found["rule"], found["policy"], found["result"], found["severity"]) == (
        reason,
        reason,
        result,
        severity,
    )
    assert found["source"] == "gpuusage"
    assert found["resources"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": "ml",
            "name": "train",
            "uid": "uid-ml-train",
        }
    ]
    assert found["properties"] == {"gpus": "GPU-0", "node": "gpu-a"}
    assert found["message"] == "1 process on node gpu-a uses GPU-0"


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("True", "ProcessesRunning"),
        ("False", "ProcessesEnded"),
        ("Unknown", "NodeReportStale"),
        ("Unknown", "UsingUnrequestedGPU"),  # a finding's reason is not a finding while Unknown
        ("False", "UsingUnrequestedGPU"),
    ],
)
def test_use_without_a_finding_and_unknown_use_publish_nothing(status: str, reason: str) -> None:
    assert pod_result(_pod(status, reason)) is None


def test_a_policy_that_announced_an_action_for_the_finding_is_named_with_it() -> None:
    since, due = NOW - timedelta(minutes=10), NOW + timedelta(minutes=50)
    shown = Announcement("idle-gpus", "HoldingIdleGPU", "ScaleToZero", "Enforce", "1h", since, due)
    found = pod_result(_pod("True", "HoldingIdleGPU", announcement=shown))
    assert found is not None
    assert found["policy"] == "idle-gpus"
    assert found["properties"] == {
        "action": "ScaleToZero",
        "dueAt": format_time(due),
        "gpus": "GPU-0",
        "mode": "Enforce",
        "node": "gpu-a",
    }
    assert found["timestamp"] == {"seconds": int(since.timestamp()), "nanos": 0}
    done = pod_result(
        _pod(
            "True",
            "HoldingIdleGPU",
            announcement=Announcement(
                "idle-gpus", "HoldingIdleGPU", "Notify", "DryRun", "1h", since, due, recorded=True
            ),
        )
    )
    assert done is not None
    assert done["properties"]["actionTaken"] == "true"
    other = Announcement("misuse", "UsingUnrequestedGPU", "Evict", "Enforce", "5m", since, due)
    unrelated = pod_result(_pod("True", "HoldingIdleGPU", announcement=other))
    assert unrelated is not None
    assert unrelated["policy"] == "HoldingIdleGPU"
    assert "action" not in unrelated["properties"]


def test_requested_gpus_idle_is_dated_from_its_idleness() -> None:
    since = NOW - timedelta(hours=3)
    found = pod_result(_pod("False", "RequestedGPUsIdle", since=since))
    assert found is not None
    assert found["timestamp"]["seconds"] == int(since.timestamp())


def test_a_stale_node_says_only_that_it_cannot_be_judged() -> None:
    orphaned = OrphanedMemory(memory_mib=512, processes=1, since=NOW)
    stale = node_results(NodeFacts("gpu-a", True, orphaned, (("GPU-0", "DeviceNotReadable"),)))
    assert [(r["rule"], r["result"], r["severity"]) for r in stale] == [
        ("NodeReportStale", "error", "medium")
    ]
    assert stale[0]["resources"] == [{"apiVersion": "v1", "kind": "Node", "name": "gpu-a"}]


def test_orphaned_memory_names_the_node_rule_and_its_due_time() -> None:
    since = NOW - timedelta(minutes=5)
    orphaned = OrphanedMemory(memory_mib=4096, processes=2, since=since)
    blind = (("GPU-1", "ProcessesNotVisible"),)
    rule = NodeRule.model_validate(
        {"finding": "OrphanedGPUMemory", "after": "30m", "action": "Taint", "mode": "Enforce"}
    )
    found = node_results(NodeFacts("gpu-a", False, orphaned, blind), ("gpu-hygiene", rule))
    assert [(r["rule"], r["policy"], r["result"]) for r in found] == [
        ("OrphanedGPUMemory", "gpu-hygiene", "warn"),
        ("BlindDevices", "BlindDevices", "error"),
    ]
    assert found[0]["properties"] == {
        "action": "Taint",
        "dueAt": format_time(since + timedelta(minutes=30)),
        "mode": "Enforce",
    }
    assert found[0]["timestamp"]["seconds"] == int(since.timestamp())
    assert "4096" not in json.dumps(found)  # no figure that changes while the finding holds
    assert "GPU-1 (ProcessesNotVisible)" in found[1]["message"]
    assert found[1]["properties"] == {"devices": "GPU-1"}
    assert node_results(NodeFacts("gpu-b", False, None)) == []


def test_a_result_keeps_the_time_it_was_first_published() -> None:
    unrequested = pod_result(_pod("True", "UsingUnrequestedGPU"))
    assert unrequested is not None
    assert "timestamp" not in unrequested
    first = stamped([unrequested], [], NOW)
    assert first[0]["timestamp"] == {"seconds": int(NOW.timestamp()), "nanos": 0}
    later = stamped([unrequested], first, NOW + timedelta(minutes=7))
    assert later == first
    other = pod_result(_pod("True", "UsingUnrequestedGPU", name="notebook"))
    assert other is not None
    both = stamped([unrequested, other], first, NOW + timedelta(minutes=7))
    assert both[1]["timestamp"]["seconds"] == int((NOW + timedelta(minutes=7)).timestamp())


def _many(count: int) -> list[dict[str, Any]]:
    pods = [
        _pod(
            "True" if i % 2 else "False",
            "UsingUnrequestedGPU" if i % 2 else "RequestedGPUsIdle",
            name=f"pod-{i:04d}",
        )
        for i in range(count)
    ]
    return stamped(namespace_results(pods)["ml"], [], NOW)


def test_a_report_lists_the_most_severe_first_and_counts_what_it_leaves_out() -> None:
    content = report_content(_many(MAX_RESULTS + 40))
    results = content["results"]
    assert len(results) == MAX_RESULTS + 1
    failing = (MAX_RESULTS + 40) // 2
    assert [r["result"] for r in results[:failing]] == ["fail"] * failing
    assert results[-1]["rule"] == "ResultsOmitted"
    assert results[-1]["properties"] == {"omitted": "40"}
    assert content["summary"] == {
        "pass": 0,
        "fail": failing,
        "warn": MAX_RESULTS - failing,
        "error": 0,
        "skip": 1,
    }
    assert content["configuration"]["limits"]["maxResults"] == MAX_RESULTS
    small = report_content(_many(3))
    assert len(small["results"]) == 3
    assert small["summary"]["skip"] == 0


def test_the_largest_report_fits_well_within_etcds_limit() -> None:
    """Every result at its largest: names of 253 characters, a message cut at its bound,
    a pod on eight GPUs, an announcement with every property."""
    long = "x" * 253
    since, due = NOW - timedelta(minutes=10), NOW + timedelta(minutes=50)
    shown = Announcement(long, "UsingUnrequestedGPU", "Evict", "Enforce", "1h", since, due, True)
    pods = [
        _pod(
            "True",
            "UsingUnrequestedGPU",
            name=f"{long[:245]}-{i:04d}",
            namespace=long[:63],
            announcement=shown,
            message="m" * 5000,
            node=long,
            gpus=",".join(f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(8)),
        )
        for i in range(MAX_RESULTS + 10)
    ]
    content = report_content(stamped(namespace_results(pods)[long[:63]], [], NOW))
    size = len(json.dumps(content))
    assert size < 0.9 * ETCD_LIMIT, size


def test_kept_results_are_those_of_the_named_nodes() -> None:
    a = node_results(NodeFacts("gpu-a", True, None))
    b = node_results(NodeFacts("gpu-b", True, None))
    content = report_content(stamped([*a, *b], [], NOW))
    assert [r["resources"][0]["name"] for r in kept_results(content, {"gpu-b"})] == ["gpu-b"]
    assert kept_results(content, set()) == []


class _Answer:
    """A raw response as the client returns it with _preload_content=False."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        """Nothing to release."""


class _Refusal(Exception):
    """The client's ApiException, as errors.translate recognises it (by name and status)."""

    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(reason)
        self.status, self.reason, self.body = status, reason, json.dumps({"reason": reason})


_Refusal.__name__ = "ApiException"


class _Reports:
    """Stands in for a CustomObjectsApi over the two report kinds: counts lists, fails calls
    as told."""

    def __init__(self) -> None:
        self.lists = 0
        self.list_error: Exception | None = None
        self.write_error: Exception | None = None
        self.stored: dict[str, dict[str, Any]] = {}

    def list_cluster_custom_object(self, *args: Any, **kwargs: Any) -> _Answer:
        self.lists += 1
        if self.list_error is not None:
            raise self.list_error
        plural = args[2]
        items = [b for k, b in self.stored.items() if (k == "") == (plural == "clusterreports")]
        return _Answer({"metadata": {}, "items": items})

    def _put(self, key: str, body: dict[str, Any]) -> _Answer:
        if self.write_error is not None:
            raise self.write_error
        body = json.loads(json.dumps(body))
        body["metadata"]["resourceVersion"] = str(len(self.stored) + 1)
        self.stored[key] = body
        return _Answer(body)

    def create_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._put(args[2], args[4])

    def replace_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._put(args[2], args[5])

    def delete_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> _Answer:
        if self.write_error is not None:
            raise self.write_error
        return _Answer(self.stored.pop(args[2]))


def test_the_writer_says_each_failure_once_and_lists_again_when_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gpuusage_operator.controller.reconcile import Counts  # noqa: PLC0415
    from gpuusage_operator.ha.terms import Terms  # noqa: PLC0415
    from gpuusage_operator.openreports.writer import Listing, OpenReportsWriter  # noqa: PLC0415

    api = _Reports()
    counts = Counts()
    terms = Terms(Listing)
    writer = OpenReportsWriter(api, counts, memory=lambda: terms.current)
    findings = namespace_results([_pod("True", "UsingUnrequestedGPU")])
    caplog.set_level(logging.INFO, logger="gpuusage_operator.openreports.writer")

    api.list_error = _Refusal(503, "ServiceUnavailable")
    for _ in range(3):
        writer.publish(findings, [], now=NOW)
    assert api.lists == 3  # asked at each pass (the first kind fails), said once
    assert len(caplog.records) == 1
    assert "not listed" in caplog.records[0].getMessage()

    api.list_error = None
    api.write_error = _Refusal(403, "Forbidden")
    for _ in range(3):
        writer.publish(findings, [], now=NOW)
    assert counts.openreport_errors == 3
    assert len(caplog.records) == 2
    assert "the Report in ml not written" in caplog.records[1].getMessage()

    api.write_error = None
    writer.publish(findings, [], now=NOW)
    assert counts.openreport_writes == 1
    lists = api.lists
    writer.publish(findings, [], now=NOW + timedelta(minutes=1))
    assert (api.lists, counts.openreport_writes) == (lists, 1)  # known: nothing to write
    terms.begin()  # a new term: another replica was active meanwhile
    writer.publish(findings, [], now=NOW + timedelta(minutes=1))
    assert (api.lists, counts.openreport_writes) == (lists + 2, 1)  # both kinds listed


def test_kept_results_are_ours_as_we_write_them() -> None:
    stale = node_results(NodeFacts("gpu-a", True, None))
    edited = {**stale[0], "severity": "unheard-of"}
    foreign = {**stale[0], "source": "kyverno"}
    content = {"results": [edited, foreign, "garbage", *stale]}
    assert kept_results(content, {"gpu-a"}) == stale


def test_only_reports_judged_in_this_term_are_published() -> None:
    from gpuusage_operator.controller.reportbook import ReportMemory  # noqa: PLC0415
    from gpuusage_operator.controller.term import new_terms  # noqa: PLC0415
    from gpuusage_operator.index.pods import PodLookup  # noqa: PLC0415
    from gpuusage_operator.openreports.gather import gather  # noqa: PLC0415

    terms = new_terms()
    book = terms.current.book
    for node in ("gpu-a", "gpu-gone"):
        book.put(node, ReportMemory(stale=True, judged_whole=True))
    found = gather(PodLookup(), book, {"gpu-a", "gpu-b"})
    assert [r["resources"][0]["name"] for r in found.nodes] == ["gpu-a"]  # gpu-gone: deleted
    assert found.keep == {"gpu-b"}  # shown, not judged yet: what is published of it stays
    terms.begin()  # a new term after standing by: what it judged may be out of date
    again = gather(PodLookup(), terms.current.book, {"gpu-a", "gpu-b"})
    assert again.nodes == []
    assert again.keep == frozenset({"gpu-a", "gpu-b"})


def test_a_new_terms_first_pass_keeps_the_findings_of_pods_on_nodes_not_judged_yet() -> None:
    """Observe first: a pod's finding comes from its report's judgement, which a new term has
    not made yet; its namespace's Report keeps the finding as published meanwhile, neither
    deleted nor written again."""
    from gpuusage_operator.controller.reconcile import Counts  # noqa: PLC0415
    from gpuusage_operator.openreports.writer import Listing, OpenReportsWriter  # noqa: PLC0415
    from tests.builders import fixed  # noqa: PLC0415

    api = _Reports()
    counts = Counts()
    writer = OpenReportsWriter(api, counts, fixed(Listing()))
    findings = namespace_results([_pod("True", "UsingUnrequestedGPU")])
    writer.publish(findings, [], now=NOW)
    assert counts.openreport_writes == 1
    node = findings["ml"][0]["properties"]["node"]
    writer.publish({}, [], keep={node}, now=NOW + timedelta(minutes=1))
    assert counts.openreport_writes == 1, "kept as published: no delete, no write"
    writer.publish({}, [], now=NOW + timedelta(minutes=2))
    assert counts.openreport_writes == 2, "judged since: its finding gone, the Report goes"
