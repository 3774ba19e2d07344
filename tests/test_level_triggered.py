"""Level-triggered, as a controller is: what a pod carries is compared with what it should
carry when the pod changes, not only when its node's report does. A hand-edited annotation is
put right and a removed condition put back (as it was: same transition time, no Event) while
the report stays as it is; what the operator remembers of a pod goes with the pod."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from tests.builders import remembered_pods
from tests.conftest import WorldFactory, wait_for
from tests.worldview import (
    condition,
    conditions,
    events,
    pod,
    pod_annotations,
    refreshed_rarely,
    report,
)


@pytest.mark.cluster
def test_hand_edits_of_the_marks_are_put_right_without_a_new_report(
    make_world: WorldFactory,
) -> None:
    # With Leases the agent rewrites an unchanged report only every 60 s: nothing but the pod
    # watch can bring the operator back to the pod within the test's 15 s.
    world = make_world({"train": 1}, leases=True, agent_lease=True, stale_after=30)
    core: client.CoreV1Api = world.core
    ns = world.ns
    memory = names.ANNOTATION_GPU_MEMORY_MIB
    wait_for(lambda: pod_annotations(world, "train").get(memory) == "30720", what="marked")
    # The condition is written after the annotations: read it once it is there.
    marked = wait_for(lambda: condition(pod(world, "train")), what="the condition written")
    assert marked.status == "True"

    generation = refreshed_rarely(world)
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
    reconciler = world.reconciler
    uid, other = world.uids["notebook"], world.uids["train"]
    # Remembered once the writes have answered (the condition can be read on the pod a moment
    # before the marker notes what it wrote).
    wait_for(lambda: {uid, other} <= remembered_pods(reconciler), what="both pods marked")
    world.core.delete_namespaced_pod("notebook", world.ns, grace_period_seconds=0)
    wait_for(lambda: uid not in remembered_pods(reconciler), timeout=15, what="forgotten")
    assert other in remembered_pods(reconciler), "the other pod is still marked"


class _Intruder:
    """The operator's CoreV1Api, with another writer's edit landing just before the
    operator's write of the pod's condition to False (once), after its annotation write."""

    def __init__(self, core: Any, pod: str, edit: Any) -> None:
        self._core = core
        self._pod = pod
        self._edit = edit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def patch_namespaced_pod_status(self, name: str, *args: Any, **kwargs: Any) -> Any:
        body = args[1] if len(args) > 1 else kwargs.get("body", {})
        wanted = [c.get("status") for c in body.get("status", {}).get("conditions", [])]
        if self._edit is not None and name == self._pod and wanted == ["False"]:
            edit, self._edit = self._edit, None
            edit()
        return self._core.patch_namespaced_pod_status(name, *args, **kwargs)


@pytest.mark.cluster
def test_an_edit_between_the_operators_two_writes_is_put_right(make_world: WorldFactory) -> None:
    """The versions of a pod the operator takes for the echoes of its writes must show what it
    wrote: a hand edit landing between its annotation write and its condition write would
    otherwise hide in the condition write's version and stay."""
    world = make_world({"train": 1, "notebook": 1})
    core: client.CoreV1Api = world.core
    ns = world.ns
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="in use")
    marker = world.reconciler.marker
    memory = names.ANNOTATION_GPU_MEMORY_MIB
    planted = {memory: "1"}
    marker.core = _Intruder(
        marker.core,
        "notebook",
        lambda: core.patch_namespaced_pod("notebook", ns, {"metadata": {"annotations": planted}}),
    )
    world.write(notebook=False)  # use ends: annotations removed, then the condition False
    wait_for(
        lambda: condition(pod(world, "notebook")).status == "False", what="the use's end marked"
    )
    assert marker.core._edit is None, "the edit landed between the two writes"
    wait_for(
        lambda: memory not in pod_annotations(world, "notebook"),
        timeout=15,
        what="the planted annotation removed",
    )
    assert world.reconciler.counts.pod_errors == 0
