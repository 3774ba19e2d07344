"""The agent's publisher: bodies the API refuses for good, refreshes that restate what was
published, and the agent's health."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuusage.api import names
from gpuusage.kube.errors import (
    TooLarge,
    TransientApiError,
    from_status,
    retried,
)
from gpuusage.retry import Backoff
from gpuusage_nodeagent.change import Decision
from gpuusage_nodeagent.gpusource.fake import FakeSource
from gpuusage_nodeagent.main import NodeReader
from gpuusage_nodeagent.metrics import AgentMetrics, healthy
from gpuusage_nodeagent.publisher import Publisher
from gpuusage_nodeagent.resolver import Resolver
from tests.builders import one_process_scenario

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
BEAT = timedelta(seconds=60)


def test_health_follows_completed_cycles() -> None:
    assert healthy(None, 1000.0, 10.0) == (True, "starting")
    assert healthy(990.0, 1000.0, 10.0)[0]
    assert healthy(940.0, 1000.0, 10.0)[0], "3 intervals + 30 s grace = 60 s"
    ok, text = healthy(939.0, 1000.0, 10.0)
    assert not ok
    assert text == "no cycle completed for 61.0s (interval 10s)"


@dataclass
class Publishing:
    """A publisher fed by a reader of a scenario file, on a clock the test moves."""

    publisher: Publisher
    reader: NodeReader
    now: list[datetime]
    metrics: AgentMetrics

    def offer_at(self, seconds: float) -> Decision:
        self.now[0] = NOW + timedelta(seconds=seconds)
        return self.publisher.offer(self.reader.read())


def _publishing(tmp_path: Path, api: Any, **options: Any) -> Publishing:
    """Publishing for `api` of a scenario with one 100 MiB process (see _scenario)."""
    path = tmp_path / "s.yaml"
    one_process_scenario(path, 100)
    metrics = AgentMetrics()
    publisher = Publisher(api, "n1", heartbeat=BEAT, threshold_mib=64, metrics=metrics, **options)
    now = [NOW]
    reader = NodeReader("n1", FakeSource(path), Resolver(tmp_path), clock=lambda: now[0])
    return Publishing(publisher, reader, now, metrics)


class RefusingApi:
    """The agent's REST client against an API that refuses any report listing processes, as
    etcd refuses a request over its limit."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.refused = 0

    def post(self, path: str, body: Any) -> dict[str, Any]:
        return {}  # no SelfSubjectReview answer: the Node is read instead

    def get(self, path: str) -> dict[str, Any]:
        return {"metadata": {"uid": "node-uid"}}

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        listed = [p for g in body["spec"].get("gpus", []) for p in g.get("processes", [])]
        if listed:
            self.refused += 1
            raise from_status(500, '{"message":"etcdserver: request is too large"}')
        self.bodies.append(body)
        return {}


def test_a_body_refused_for_good_is_never_sent_again_and_the_refusal_is_published(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = RefusingApi()
    publishing = _publishing(tmp_path, api)
    metrics = publishing.metrics
    for later in (0, 1, 60):  # the same observation: first write, unchanged, heartbeat
        publishing.offer_at(later)
    assert api.refused == 1, "the refused body was sent once, not retried, not re-sent"
    assert len(api.bodies) == 2, "the report without processes, then its heartbeat"
    assert api.bodies[-1] == {"spec": {"observedAt": "2026-11-21T12:01:00Z"}}, (
        "the heartbeat refreshes observedAt alone: the stored report stays the one without"
    )
    spec = api.bodies[0]["spec"]
    assert "the API refused this node's full report" in spec["source"]["message"]
    assert "request is too large" in spec["source"]["message"]
    assert spec["gpus"][0]["error"]["reason"] == "ReportRefused"
    failures = metrics.registry.get_sample_value(
        "gpuusage_agent_api_failures_total", {"kind": "TooLarge"}
    )
    assert failures == 1
    assert metrics.registry.get_sample_value("gpuusage_agent_writes_skipped_total") == 1
    assert sum("refused the report" in r.getMessage() for r in caplog.records) == 1
    # The observation changes: the full report is tried again (and refused again, once).
    one_process_scenario(tmp_path / "s.yaml", 900)
    publishing.offer_at(3 * BEAT.total_seconds())
    assert api.refused == 2


def test_etcds_and_the_apiservers_size_refusals_are_permanent() -> None:
    assert isinstance(from_status(500, '{"message":"etcdserver: request is too large"}'), TooLarge)
    assert isinstance(from_status(413, "{}"), TooLarge)
    assert isinstance(
        from_status(500, '{"message":"etcdserver: leader changed"}'), TransientApiError
    )
    attempts: list[int] = []

    def refused() -> None:
        attempts.append(1)
        raise from_status(413, '{"message":"Request entity too large"}')

    with pytest.raises(TooLarge):
        retried(refused, "test", backoff=Backoff((0.0, 0.0)), sleep=lambda _: None)
    assert attempts == [1], "not retried"


class RecordingApi:
    """Takes every write as the apiserver would, and keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def post(self, path: str, body: Any) -> dict[str, Any]:
        return {}  # no SelfSubjectReview answer: the Node is read instead

    def get(self, path: str) -> dict[str, Any]:
        return {"metadata": {"uid": "node-uid"}}

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        self.bodies.append(body)
        return {}


def test_refreshes_restate_the_published_content_never_the_jitter(tmp_path: Path) -> None:
    """An unchanged report is refreshed with observedAt alone, and every sixth time with the
    whole spec as it was published (undoing anyone else's edit), never with the few MiB the
    memory moved since: the operator has nothing to rewrite on the pods."""
    path = tmp_path / "s.yaml"
    one_process_scenario(path, 100)
    api = RecordingApi()
    publisher = Publisher(api, "n1", heartbeat=BEAT, threshold_mib=64, metrics=AgentMetrics())  # type: ignore[arg-type]
    now = [NOW]
    reader = NodeReader("n1", FakeSource(path), Resolver(tmp_path), clock=lambda: now[0])
    publisher.offer(reader.read())
    for n in range(1, 13):
        one_process_scenario(path, 100 + n)  # jitter, below the threshold
        now[0] = NOW + n * BEAT
        publisher.offer(reader.read())
    refreshes = api.bodies[1:]
    assert len(refreshes) == 12
    whole = [n for n, body in enumerate(refreshes, start=1) if "gpus" in body["spec"]]
    assert whole == [6, 12]
    assert refreshes[0] == {"spec": {"observedAt": "2026-11-21T12:01:00Z"}}
    used = refreshes[5]["spec"]["gpus"][0]["processes"][0]["usedMemoryMiB"]
    assert used == 100, "the published value, not the jittered 106"
    assert refreshes[5]["spec"]["observedAt"] == "2026-11-21T12:06:00Z"


class JudgingApi(RecordingApi):
    """Answers each write with the report as stored, its status saying how the operator
    judges the node (the Stale condition's reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        super().merge_patch(path, body)
        if self.reason is None:
            return {"metadata": {"name": "n1"}, "spec": {}}
        stale = {"type": "Stale", "status": "False", "reason": self.reason}
        return {"metadata": {"name": "n1"}, "status": {"conditions": [stale]}}


def test_an_unchanged_report_is_refreshed_rarely_only_once_the_lease_is_what_counts(
    tmp_path: Path,
) -> None:
    """An agent with a Lease keeps refreshing every heartbeat until the report's status says
    the operator judges the node by the Lease: under an operator of an earlier version (no
    status of that kind) a rare refresh would turn a live node stale."""
    path = tmp_path / "s.yaml"
    one_process_scenario(path, 100)
    api = JudgingApi()
    publisher = Publisher(
        api,  # type: ignore[arg-type]
        "n1",
        heartbeat=BEAT,
        threshold_mib=64,
        metrics=AgentMetrics(),
        lease_refresh=5 * BEAT,
    )
    now = [NOW]
    reader = NodeReader("n1", FakeSource(path), Resolver(tmp_path), clock=lambda: now[0])

    def minutes(start: int, end: int) -> int:
        """Offer a reading every 10 s over these minutes; the writes made."""
        before = len(api.bodies)
        for tick in range(start * 6, end * 6):
            now[0] = NOW + tick * BEAT / 6
            publisher.offer(reader.read())
        return len(api.bodies) - before

    assert minutes(0, 10) == 10, "no status: the first write, then every heartbeat"
    api.reason = "ReportFresh"  # an operator that does not read the Lease
    assert minutes(10, 20) == 10
    api.reason = names.STALE_REASON_LEASE
    assert minutes(20, 21) == 1, "the answer that says so"
    assert publisher.refresh_every == 5 * BEAT
    assert minutes(21, 41) == 4, "every five minutes"
    api.reason = "ReportFresh"  # the operator lost the Lease: seen at the next refresh
    assert minutes(41, 51) == 6, "one more five-minute refresh, then every heartbeat"
    assert publisher.refresh_every == BEAT


class PolicyRefusingApi(RefusingApi):
    """An API whose admission policy refuses reports listing processes (422) until fixed."""

    fixed = False

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        listed = [p for g in body["spec"].get("gpus", []) for p in g.get("processes", [])]
        if listed and not self.fixed:
            self.refused += 1
            raise from_status(422, '{"message":"ValidatingAdmissionPolicy denied request"}')
        self.bodies.append(body)
        return {}


def test_a_body_a_policy_refused_is_tried_again_a_refresh_later(tmp_path: Path) -> None:
    """A refusal by validation may not last (the policy or webhook gets fixed): the full
    report is tried again one refresh after the refusal, not every cycle."""
    api = PolicyRefusingApi()
    publishing = _publishing(tmp_path, api)
    publishing.offer_at(0)
    publishing.offer_at(30)
    assert (api.refused, publishing.publisher.current) == (1, True), "the refusal is published"
    api.fixed = True
    publishing.offer_at(BEAT.total_seconds())
    assert api.refused == 1
    assert api.bodies[-1]["spec"]["gpus"][0]["processes"], "the full report, a refresh later"
    assert "refused" not in (api.bodies[-1]["spec"]["source"].get("message") or "")
