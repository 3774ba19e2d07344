"""A report rewritten many times a second is reconciled at a bounded rate, its latest version
each time; pod writes and Events across the cluster draw from budgets."""

from __future__ import annotations

import copy
import itertools
import time
from collections import defaultdict
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage_operator.controller.debounce import DEFAULT_INTERVAL, Debounce
from gpuusage_operator.writers.budget import WriteBudget
from tests.conftest import GPU0, WorldFactory, wait_for
from tests.worldview import condition, pod, pod_annotations, report


def test_a_report_waits_out_its_interval() -> None:
    debounce = Debounce(interval=1.0)
    assert debounce.wait("n1", 100.0) == 0.0, "never reconciled: at once"
    debounce.ran("n1", 100.0)
    assert debounce.wait("n1", 100.4) == pytest.approx(0.6)
    assert debounce.wait("n2", 100.4) == 0.0, "per report"
    assert debounce.wait("n1", 101.5) == 0.0, "the interval passed"
    debounce.ran("n1", 101.0)
    debounce.forget("n1")
    assert debounce.wait("n1", 101.1) == 0.0
    assert len(debounce) == 0, "n1 forgotten, n2 never reconciled"


def test_the_write_budget_allows_a_burst_then_its_rate() -> None:
    budget = WriteBudget(rate=10.0, burst=5)
    assert [budget.take(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert not budget.take(0.05), "half a token"
    assert budget.take(0.1)
    assert not budget.take(0.1, writes=2), "all or none: annotations and condition together"
    assert budget.take(10.0, writes=2), "refilled, never beyond the burst"
    assert [budget.take(10.0) for _ in range(4)] == [True, True, True, False]


@pytest.mark.cluster
def test_a_report_rewritten_twenty_times_a_second_is_reconciled_about_once_a_second(
    make_world: WorldFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = make_world({"train": 1}, stale_after=60)
    reconciler = world.reconciler
    memory = names.ANNOTATION_GPU_MEMORY_MIB
    wait_for(lambda: pod_annotations(world, "train").get(memory) == "30720", what="marked")
    world.agent.halt()  # from here on the test writes the report, as a runaway agent would
    custom = client.CustomObjectsApi(world.api)
    spec = report(world)["spec"]
    # When this report's reconciles began: the operator also reconciles the reports other
    # tests left in the cluster (each turning stale in its time).
    began: dict[str, list[float]] = defaultdict(list)
    reconcile = reconciler.reconcile

    def counting(body: dict[str, Any], *args: Any) -> bool:
        began[body["metadata"]["name"]].append(time.monotonic())
        return bool(reconcile(body, *args))

    monkeypatch.setattr(reconciler, "reconcile", counting)
    started = time.monotonic()
    last = 0
    for n in range(100):
        rewritten = copy.deepcopy(spec)
        last = 20000 + n
        rewritten["gpus"][0]["processes"][0]["usedMemoryMiB"] = last
        rewritten["gpus"][0]["memory"]["usedMiB"] = last + 512
        custom.patch_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, world.node, {"spec": rewritten}
        )
        time.sleep(max(0.0, started + (n + 1) / 20 - time.monotonic()))
    elapsed = time.monotonic() - started
    # (the status says every MiB; the pod's annotation only moves of a step, every ten minutes)
    wait_for(
        lambda: [p["usedMemoryMiB"] for p in report(world)["status"]["pods"]] == [last],
        timeout=15,
        what="the latest version reconciled",
    )
    times = began[world.node]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    print(f"100 rewrites in {elapsed:.1f} s: {len(times)} reconciles, gaps from {min(gaps):.2f} s")
    assert len(times) < 100, "the rewrites were not each reconciled"
    # Never two within the interval (1 s; a reconcile begins a moment after the worker
    # stamps its start, so a gap may look a little shorter, never half as short).
    assert min(gaps) >= DEFAULT_INTERVAL / 2, gaps


@pytest.mark.cluster
def test_pod_writes_beyond_the_cluster_budget_wait_and_still_arrive(
    make_world: WorldFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget of two writes at once and one a second: four pods to mark (two writes each)
    are marked one after the other, the rest deferred meanwhile, none lost."""
    pods = {"a": 1, "b": 1, "c": 1, "d": 1}
    world = make_world(pods, operator_extras={"pod_writes_per_second": 1.0, "pod_write_burst": 2})
    world.scenario(
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "processes": [{"pid": world.pids[name], "usedMemoryMiB": 1024} for name in pods],
            }
        ]
    )
    reconciler = world.reconciler
    written: list[float] = []  # when each pod write returned
    write = reconciler.marker.write

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        answer = write(*args, **kwargs)
        written.append(time.monotonic())
        return answer

    monkeypatch.setattr(reconciler.marker, "write", recording)

    def marked(name: str) -> bool:
        try:
            return bool(condition(pod(world, name)).status == "True")
        except StopIteration:  # no condition yet
            return False

    wait_for(
        lambda: all([marked(name) for name in pods]),
        timeout=30,
        what="all four pods marked",
    )
    assert reconciler.counts.writes_deferred > 0, "some pods waited for the budget"
    assert len(written) >= 8
    # The bucket's promise, write by write: by the k-th write, at most the burst plus one a
    # second since the first (half a write's leeway: a write is stamped when it returned).
    for k, at in enumerate(written):
        assert k + 1 <= 2 + 1.0 * (at - written[0]) + 0.5, (k, at - written[0])
