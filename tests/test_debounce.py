"""A report rewritten many times a second is reconciled at a bounded rate, its latest version
each time; pod writes and Events across the cluster draw from budgets."""

from __future__ import annotations

import copy
import time
from collections import Counter
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage_operator.controller.debounce import Debounce, WriteBudget
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
    # Count this report's reconciles only: the operator also reconciles the reports other
    # tests left in the cluster (each turning stale in its time).
    counted: Counter[str] = Counter()
    reconcile = reconciler.reconcile

    def counting(body: dict[str, Any], *args: Any) -> bool:
        counted[body["metadata"]["name"]] += 1
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
    wait_for(
        lambda: pod_annotations(world, "train").get(memory) == str(last),
        timeout=15,
        what="the latest version reconciled",
    )
    reconciles = counted[world.node]
    others = sum(counted.values()) - reconciles
    print(f"100 rewrites in {elapsed:.1f} s: {reconciles} reconciles (other reports: {others})")
    assert reconciles <= elapsed + 4, f"{reconciles} reconciles in {elapsed:.1f} s"


@pytest.mark.cluster
def test_pod_writes_beyond_the_cluster_budget_wait_and_still_arrive(
    make_world: WorldFactory,
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
    started = time.monotonic()

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
    took = time.monotonic() - started
    assert reconciler.counts.writes_deferred > 0, "some pods waited for the budget"
    assert took >= 4.0, f"eight writes at one a second after a burst of two took {took:.1f} s"
