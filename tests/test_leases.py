"""Leases without a control plane: the agent's renewals (when, what, what on failure) and what
the operator makes of the Leases it lists and watches (on the cluster: test_lease_on_cluster,
and under real tokens: test_install)."""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuusage.api.times import format_micro_time
from gpuusage.kube.errors import Invalid, NotFound, TransientApiError
from gpuusage.retry import Backoff
from gpuusage_nodeagent.change import Decision
from gpuusage_nodeagent.gpusource.base import Reading
from gpuusage_nodeagent.lease import LEASE_DURATION, LeaseRenewer
from gpuusage_nodeagent.main import NodeReader, run_cycles
from gpuusage_nodeagent.metrics import AgentMetrics
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.informers.leasewatch import LeaseState, Seen
from tests.builders import FAKE_SOURCE

T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
NO_WAIT = Backoff((0.0,), jitter=0.0)


class LeaseApi:
    """Answers as the apiserver does for one Lease: 404 on a patch until it was created."""

    def __init__(self, fail: bool = False) -> None:
        self.exists = False
        self.fail = fail
        self.calls: list[tuple[str, str, Any]] = []

    def post(self, path: str, body: Any) -> dict[str, Any]:
        self.calls.append(("post", path, body))
        if path.endswith("selfsubjectreviews"):
            extra = {
                "authentication.kubernetes.io/node-name": ["n1"],
                "authentication.kubernetes.io/node-uid": ["node-uid-1"],
            }
            return {"status": {"userInfo": {"extra": extra}}}
        self.exists = True
        return body  # type: ignore[no-any-return]

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        self.calls.append(("patch", path, body))
        if self.fail:
            raise TransientApiError("etcdserver: leader changed", 500)
        if not self.exists:
            raise NotFound("leases.coordination.k8s.io not found", 404)
        return {}

    def get(self, path: str) -> dict[str, Any]:
        raise AssertionError("the agent reads nothing: the Node's UID comes from its token")


def _renewer(api: LeaseApi, metrics: AgentMetrics | None = None) -> LeaseRenewer:
    return LeaseRenewer(
        api,  # type: ignore[arg-type]
        "gpuusage-system",
        "n1",
        metrics=metrics or AgentMetrics(),
        backoff=NO_WAIT,
        duration=LEASE_DURATION,
        holder="gpuusage-agent/pod-1",
    )


def test_created_owned_by_the_node_then_renewed_every_third_of_its_duration() -> None:
    api = LeaseApi()
    metrics = AgentMetrics()
    renewer = _renewer(api, metrics)
    assert renewer.renew_if_due(T0)
    created = next(body for verb, path, body in api.calls if path.endswith("/leases"))
    assert created["metadata"]["name"] == "n1"
    assert created["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "node-uid-1"}
    ]
    assert created["spec"] == {
        "holderIdentity": "gpuusage-agent/pod-1",
        "leaseDurationSeconds": 60,
        "renewTime": "2026-11-24T09:00:00.000000Z",
        "acquireTime": "2026-11-24T09:00:00.000000Z",
    }
    api.calls.clear()
    assert not renewer.renew_if_due(T0 + timedelta(seconds=17)), "not due yet"
    assert renewer.renew_if_due(T0 + timedelta(seconds=19)), "a tenth early is due"
    ((verb, path, body),) = api.calls
    assert (verb, path) == (
        "patch",
        "/apis/coordination.k8s.io/v1/namespaces/gpuusage-system/leases/n1",
    )
    assert body == {
        "spec": {
            "holderIdentity": "gpuusage-agent/pod-1",
            "leaseDurationSeconds": 60,
            "renewTime": format_micro_time(T0 + timedelta(seconds=19)),
        }
    }
    writes = metrics.registry.get_sample_value("gpuusage_agent_api_writes_total", {"verb": "lease"})
    assert writes == 1


def test_a_failed_renewal_is_counted_and_tried_again_next_cycle() -> None:
    api = LeaseApi(fail=True)
    metrics = AgentMetrics()
    renewer = _renewer(api, metrics)
    with pytest.raises(TransientApiError):
        renewer.renew_if_due(T0)
    assert renewer.due(T0 + timedelta(seconds=1)), "not counted as renewed"
    failures = metrics.registry.get_sample_value(
        "gpuusage_agent_api_failures_total", {"kind": "TransientApiError"}
    )
    assert failures == 1


def test_a_cycle_that_fails_renews_nothing(tmp_path: Path) -> None:
    """Liveness vouches for the report: only a completed cycle whose report stands published
    renews the Lease."""

    class Broken:
        def read(self) -> Reading:
            raise RuntimeError("a bug in a source")

        def poll(self) -> None:
            """No sampler."""

        def sample_shares(self, devices: Collection[str], span: float) -> None:
            """No share reads."""

        def close(self) -> None:
            """Nothing to release."""

    class Working:
        def read(self) -> Reading:
            return Reading(FAKE_SOURCE, [])

        def poll(self) -> None:
            """No sampler."""

        def sample_shares(self, devices: Collection[str], span: float) -> None:
            """No share reads."""

        def close(self) -> None:
            """Nothing to release."""

    class Recorder:
        current = True  # what it offers stands published

        def offer(self, attributed: Any, force: bool = False) -> Decision:
            return Decision(True, "first report")

    class Refused(Recorder):
        current = False

        def offer(self, attributed: Any, force: bool = False) -> Decision:
            raise Invalid("denied by a policy", 422)

    settings = AgentSettings(node_name="n1", interval=0.01, metrics_port=0)
    for source, renewals, publisher in (
        (Broken(), 0, Recorder()),
        (Working(), 1, Recorder()),
        (Working(), 0, Refused()),
    ):
        api = LeaseApi()
        api.exists = True
        metrics = AgentMetrics()
        stop = threading.Event()
        ended = threading.Timer(0.3, stop.set)  # bounds the run; the clock stands still
        ended.start()
        run_cycles(
            settings,
            NodeReader("n1", source, Resolver(tmp_path), clock=lambda: T0),
            publisher,  # type: ignore[arg-type]
            metrics,
            stop,
            renewer=_renewer(api),
        )
        cycles = metrics.registry.get_sample_value(
            "gpuusage_agent_cycle_failures_total", {"kind": "RuntimeError"}
        )
        assert len([c for c in api.calls if c[0] == "patch"]) == renewals
        written = metrics.registry.get_sample_value("gpuusage_agent_cycle_duration_seconds_count")
        assert renewals or (cycles or 0) >= 2 or (written or 0) >= 2, "cycles ran"


def _lease(name: str, renew: str | None, holder: str = "gpuusage-agent/p") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"holderIdentity": holder, "renewTime": renew}}


def test_what_the_operator_counts_as_a_renewal() -> None:
    now = [T0]
    memory: dict[str, Seen] = {}
    news: list[set[str]] = []
    state = LeaseState(memory, lambda: now[0], news.append)
    state.apply("ADDED", _lease("n1", "2026-11-24T08:59:50.000000Z"))
    state.apply("ADDED", _lease("kube-thing", "2026-11-24T08:59:50.000000Z", holder="other"))
    assert memory == {"n1": Seen("2026-11-24T08:59:50.000000Z", T0, witnessed=False)}
    assert news == [{"n1"}], "a new Lease is news: the report's freshness is judged anew"
    now[0] = T0 + timedelta(seconds=10)
    state.apply("MODIFIED", _lease("n1", "2026-11-24T09:00:00.000000Z"))
    assert memory["n1"] == Seen("2026-11-24T09:00:00.000000Z", now[0], witnessed=True)
    # A list after an interruption finds the Lease as it is: the same renewTime is no renewal.
    relisted = LeaseState(memory, lambda: T0 + timedelta(minutes=5), news.append)
    relisted.apply("ADDED", _lease("n1", "2026-11-24T09:00:00.000000Z"))
    assert memory["n1"].seen_at == T0 + timedelta(seconds=10)
    relisted.apply("DELETED", _lease("n1", None))
    assert memory == {}
    assert news[-1] == {"n1"}


def test_the_operator_keeps_each_leases_duration_and_hears_when_it_changes() -> None:
    memory: dict[str, Seen] = {}
    news: list[set[str]] = []
    state = LeaseState(memory, lambda: T0, news.append)
    renewed = "2026-11-24T08:59:50.000000Z"
    first = _lease("n1", renewed)
    first["spec"]["leaseDurationSeconds"] = 40
    state.apply("ADDED", first)
    assert memory["n1"].duration == timedelta(seconds=40)
    longer = _lease("n1", renewed)
    longer["spec"]["leaseDurationSeconds"] = 120
    state.apply("MODIFIED", longer)  # no renewal, a new duration: when it turns stale moved
    assert memory["n1"] == Seen(renewed, T0, witnessed=False, duration=timedelta(seconds=120))
    assert news == [{"n1"}, {"n1"}]
    broken = _lease("n1", renewed)
    broken["spec"]["leaseDurationSeconds"] = "soon"
    state.apply("MODIFIED", broken)
    assert memory["n1"].duration is None  # judged by the operator's default then


def test_renewals_the_operator_could_not_watch_for_are_not_counted_against_the_node() -> None:
    """While the Lease watch is interrupted, and from its next list until a renewal is seen,
    the agent is given from that list on: the operator's own blind spell (an apiserver
    restart) never makes a live node stale. Such a floor is no witnessed renewal."""
    from gpuusage_operator.informers.leasewatch import LeaseWatch  # noqa: PLC0415

    now = [T0]
    watch = LeaseWatch(None, "system", clock=lambda: now[0])
    watch.available.set()
    watch.informer.state.apply("ADDED", _lease("n1", "2026-11-24T08:59:50.000000Z"))
    watch.informer.synced.set()
    now[0] = T0 + timedelta(seconds=10)
    watch.informer.state.apply("MODIFIED", _lease("n1", "2026-11-24T09:00:10.000000Z"))
    seen = watch.renewal("n1")
    assert seen is not None
    assert (seen.seen_at, seen.witnessed) == (T0 + timedelta(seconds=10), True)

    watch.informer.synced.clear()  # the watch breaks; a list is tried again 30 s later
    now[0] = T0 + timedelta(seconds=40)
    relisted = watch._new_state()
    blind = watch.renewal("n1")
    assert blind is not None
    assert (blind.seen_at, blind.witnessed) == (T0 + timedelta(seconds=40), False)
    relisted.apply("ADDED", _lease("n1", "2026-11-24T09:00:10.000000Z"))  # no renewal since
    watch.informer.synced.set()
    now[0] = T0 + timedelta(seconds=45)
    after = watch.renewal("n1")
    assert after is not None
    assert (after.seen_at, after.witnessed) == (T0 + timedelta(seconds=40), False)
    relisted.apply("MODIFIED", _lease("n1", "2026-11-24T09:00:45.000000Z"))
    renewed = watch.renewal("n1")
    assert renewed is not None
    assert (renewed.seen_at, renewed.witnessed) == (T0 + timedelta(seconds=45), True)


def test_a_lease_gone_while_the_watch_was_interrupted_is_news_after_the_next_list() -> None:
    """A list again that no longer finds a Lease forgets what was seen of it and makes its
    node's report due (its freshness is judged by the report alone again); Leases still there
    are no news."""
    from gpuusage_operator.informers.leasewatch import LeaseWatch  # noqa: PLC0415

    class Pages:
        def __init__(self, *lists: list[dict[str, Any]]) -> None:
            self.lists = list(lists)

        def list_namespaced_lease(self, namespace: str, **_: Any) -> Any:
            page = {"metadata": {"resourceVersion": "1"}, "items": self.lists.pop(0)}
            return SimpleNamespace(data=json.dumps(page).encode(), release_conn=lambda: None)

    news: list[set[str]] = []
    both = [
        _lease("n1", "2026-11-24T08:59:50.000000Z"),
        _lease("n2", "2026-11-24T08:59:50.000000Z"),
    ]
    watch = LeaseWatch(Pages(both, both[:1]), "system", clock=lambda: T0, on_news=news.append)
    watch.available.set()  # as start() leaves it once the probe answered
    watch.informer.list_all()
    assert news == [{"n1"}, {"n2"}]
    watch.informer.list_all()  # n2's Lease deleted while no watch was open
    assert news[2:] == [{"n2"}]
    assert watch.renewal("n2") is None
    assert watch.renewal("n1") is not None
