"""Level-triggered, as a controller is: what a pod carries is compared with what it should
carry when the pod changes, not only when its node's report does. A hand-edited annotation is
put right and a removed condition put back (as it was: same transition time, no Event) while
the report stays as it is; what the operator remembers of a pod goes with the pod."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from tests.conftest import WorldFactory, wait_for
from tests.worldview import condition, conditions, events, pod, pod_annotations, report


@pytest.mark.cluster
def test_hand_edits_of_the_marks_are_put_right_without_a_new_report(
    make_world: WorldFactory,
) -> None:
    # With Leases the agent rewrites an unchanged report only every 60 s: nothing but the pod
    # watch can bring the operator back to the pod within the test's 15 s.
    world = make_world({"train": 1}, leases=True, agent_lease=True, stale_after=30)
    core: client.CoreV1Api = world["core"]
    ns = world["ns"]
    memory = names.ANNOTATION_GPU_MEMORY_MIB
    wait_for(lambda: pod_annotations(world, "train").get(memory) == "30720", what="marked")
    marked = condition(pod(world, "train"))
    assert marked.status == "True"

    def settled() -> int | None:
        """The report's generation once the agent refreshes it only every 60 s: the status
        says the Lease is what counts, and no write came for longer than its heartbeat."""
        found = report(world)
        listed = (found.get("status") or {}).get("conditions") or []
        stale: dict[str, Any] = next((c for c in listed if c["type"] == "Stale"), {})
        if stale.get("reason") != "LeaseRenewed":
            return None
        generation = found["metadata"]["generation"]
        time.sleep(3)  # three of the agent's 1 s heartbeats: a write would have come
        return generation if report(world)["metadata"]["generation"] == generation else None

    generation = wait_for(settled, timeout=30, what="the report refreshed only every 60 s")
    before = events(world, "train")

    core.patch_namespaced_pod("train", ns, {"metadata": {"annotations": {memory: "1"}}})
    wait_for(
        lambda: pod_annotations(world, "train").get(memory) == "30720",
        timeout=15,
        what="the hand-edited annotation put right",
    )

    index = next(
        i
        for i, c in enumerate(conditions(pod(world, "train")))
        if c.type == names.POD_CONDITION_GPU_IN_USE
    )
    core.patch_namespaced_pod_status(
        "train", ns, [{"op": "remove", "path": f"/status/conditions/{index}"}]
    )
    restored = wait_for(
        lambda: condition(pod(world, "train")), timeout=15, what="the removed condition back"
    )
    assert (restored.status, restored.reason) == (marked.status, marked.reason)
    assert restored.last_transition_time == marked.last_transition_time, "as it was"
    assert events(world, "train") == before, "nothing happened to the pod's GPU use"
    assert report(world)["metadata"]["generation"] == generation, "no new report needed"


@pytest.mark.cluster
def test_what_the_operator_remembers_of_a_pod_goes_with_it(make_world: WorldFactory) -> None:
    world = make_world({"train": 1, "notebook": 1})
    reconciler = world["reconciler"]
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="marked")
    uid = world["notebook"]
    assert uid in reconciler.remembered_pods()
    world["core"].delete_namespaced_pod("notebook", world["ns"], grace_period_seconds=0)
    wait_for(lambda: uid not in reconciler.remembered_pods(), timeout=15, what="forgotten")
    assert world["train"] in reconciler.remembered_pods(), "the other pod is still marked"
