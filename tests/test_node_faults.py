"""When the node's own parts fail, on the real node with the product installed as users install
it (the agent's DaemonSet, the operator's Deployment): two pods use the GPUs they were given,
one uses a GPU it never requested. Each fault, then a seeded sequence of them (the soak), must
leave no wrong mark: no running pod marked stopped, no misuse flag gained or lost, no second
GPUUseStarted; the node fresh again within two Lease durations of the part's return."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from benchmarks.node_fault_soak import (
    FAULTS,
    LEASE_S,
    Workload,
    fresh_after,
    put_to_work,
    run_node_soak,
)
from gpuusage.api import names
from tests.conftest import wait_for
from tests.nodeworld import (
    NodeWorld,
    installed_world,
)
from tests.witness import Witness

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

SOAK_SECONDS = float(os.environ.get("GPUUSAGE_NODE_SOAK_SECONDS", "180"))
"""The soak's length: CI's short form; benchmarks/node_fault_soak.py runs 20 minutes."""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeWorld]:
    yield from installed_world(
        tmp_path_factory.mktemp("node-faults"),
        agent_args=("--interval", "1", "--lease-duration", str(int(LEASE_S))),
    )


@pytest.fixture(scope="module")
def workloads(world: NodeWorld) -> dict[str, Workload]:
    return put_to_work(world)


@pytest.fixture(scope="module")
def witness(world: NodeWorld, workloads: dict[str, Workload]) -> Iterator[Witness]:
    namespace = next(iter(workloads.values())).namespace
    seen = Witness(world.api, namespace).start()
    _prove_it_watches(world, namespace, seen)
    yield seen
    seen.stop()


def _prove_it_watches(world: NodeWorld, namespace: str, seen: Witness) -> None:
    """A witness that hears nothing passes every test: a pod that never runs (its node does
    not exist) gets a GPUInUse condition by hand, and the witness must see it arrive."""
    wait_for(lambda: seen.since(0), what="the witness's first list (the pods at work)")
    core = client.CoreV1Api(world.api)
    body: Any = {
        "metadata": {"name": "witness-probe"},
        "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": "none"}]},
    }
    probe: Any = core.create_namespaced_pod(namespace, body)
    planted = {"type": names.POD_CONDITION_GPU_IN_USE, "status": "False", "reason": "Probe"}
    core.patch_namespaced_pod_status(
        "witness-probe", namespace, {"status": {"conditions": [planted]}}
    )
    wait_for(
        lambda: any(s.uid == probe.metadata.uid and s.reason == "Probe" for s in seen.since(0)),
        what="the witness seeing a condition arrive through its watch",
    )
    core.delete_namespaced_pod("witness-probe", namespace, grace_period_seconds=0)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_node_part_that_fails_leaves_no_wrong_mark(
    world: NodeWorld, workloads: dict[str, Workload], witness: Witness, fault: str
) -> None:
    mark = witness.mark()
    back = FAULTS[fault](world, workloads, None)
    recovered = fresh_after(world, workloads, back)
    assert recovered <= 2 * LEASE_S, f"fresh {recovered:.1f} s after the {fault} came back"
    uses = {w.uid: w.reason for w in workloads.values()}
    assert witness.wrong_marks(uses, set(uses)) == []
    for work in workloads.values():
        last = witness.last(work.uid)
        assert last is not None, "the witness sees the pods"
        assert (last.status, last.reason) == ("True", work.reason), work.name
        started = ["GPUUseStarted"] if work.reason == "ProcessesRunning" else []
        assert [r for r in witness.reasons(work.uid) if r != work.reason] == started
    # The agent's and the operator's pods, recreated by some faults, carry no GPU marks.
    listed: Any = client.CoreV1Api(world.api).list_namespaced_pod("gpuusage-system")
    for system in listed.items:
        marks = [k for k in system.metadata.annotations or {} if k.startswith(names.GROUP)]
        conditions = [c.type for c in system.status.conditions or []]
        assert marks == [], system.metadata.name
        assert names.POD_CONDITION_GPU_IN_USE not in conditions, system.metadata.name
    # What the pods showed while it lasted (docs/node-faults.md).
    shown = sorted({(c.status, c.reason) for c in witness.since(mark)})
    print(f"\n{fault}: fresh {recovered:.1f} s after its return; the pods showed {shown}")


def test_a_seeded_soak_of_node_faults_leaves_no_wrong_mark(
    world: NodeWorld, workloads: dict[str, Workload], witness: Witness
) -> None:
    figures = run_node_soak(world, workloads, witness, seconds=SOAK_SECONDS, seed=36)
    print(f"\nsoak: {figures}")
    assert figures["wrong"] == []
    assert figures["faults"], "at least one fault in the soak"
    assert max(figures["recovery_s"]) <= 2 * LEASE_S, figures
    core = client.CoreV1Api(world.api)
    for work in workloads.values():
        pod: Any = core.read_namespaced_pod(work.name, work.namespace)
        assert pod.metadata.uid == work.uid, "the workloads ran throughout"
