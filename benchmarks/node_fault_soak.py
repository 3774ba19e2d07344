"""Node fault soak: the real node's own parts fail again and again, at random, while pods use
their GPUs, and every mark gpuusage writes is watched for the whole time.

The real node (kubelet, containerd, runc, our device plugin) with the product installed as users
install it: the agent's DaemonSet, the operator's Deployment. Two pods use the GPU the kubelet
gave each; a third, which requested none, uses another (UsingUnrequestedGPU). A seeded sequence
of faults follows: the kubelet crashed and away for 5-30 s, containerd crashed, the device
plugin crashed, the agent's pod deleted, the agent's container killed (as its memory limit
kills it), the operator's pod killed right after a change it must write, the apiserver
restarted. After each, the time from the part's return until the node is fresh again (the
agent's Lease renewed since, the report not stale, the kubelet read, every pod's marks true);
throughout, a witness watching the pods and Events counts wrong marks (tests/witness.py).

    sudo python benchmarks/node_fault_soak.py --minutes 20     # the soak (docs/node-faults.md)

`tests/test_node_faults.py` proves each fault once, then runs the soak for 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the tests package; gpuusage is installed

from gpuusage.api import names  # noqa: E402
from gpuusage.retry import poll_until  # noqa: E402
from gpuusage_dev.localcluster.node import Node, NodeComponent, write_scenario  # noqa: E402
from gpuusage_dev.localcluster.workloads import sleeper_deployment  # noqa: E402
from gpuusage_dev.simulation import ensure_namespace  # noqa: E402
from gpuusage_nodeagent.podresources.kubelet import list_pods  # noqa: E402
from gpuusage_nodeagent.podresources.wire import list_response  # noqa: E402
from gpuusage_operator.writers.marks import (  # noqa: E402
    DETAIL_EVERY,
    MEMORY_STEP,
    MEMORY_STEP_MIB,
)
from tests.nodeworld import NodeWorld, installed_world  # noqa: E402

LEASE_S = 10.0
"""The agent's --lease-duration here (renewed every 2.5 s): the node must be fresh again
within two of them after a part's return."""
NAMESPACE = "faults"
SYSTEM = "gpuusage-system"
NODE = "gpu-node-a"
KUBELET_AWAY_S = 30.0
"""How long the kubelet stays away in the fault's own test (an upgrade's restart)."""


@dataclass
class Workload:
    """A Deployment's pod at work on the node: the device its process is on, the condition
    reason its use deserves, and the memory its annotation must show."""

    name: str
    namespace: str
    uid: str
    pid: int
    device: str
    reason: str
    memory_mib: int


def _running(core: client.CoreV1Api, namespace: str, selector: str) -> Any:
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    ready = [p for p in pods if p.status and p.status.phase == "Running"]
    return ready[0] if len(ready) == 1 and len(pods) == 1 else None


def _wait(what: str, predicate: Callable[[], Any], timeout: float = 180.0) -> Any:
    def probe() -> Any:
        try:
            return predicate()
        except (client.ApiException, KeyError, IndexError, TypeError, ValueError):
            return None  # the apiserver away, or the object not there yet

    found = poll_until(probe, timeout, 0.2)
    if not found:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
    return found


def put_to_work(world: NodeWorld) -> dict[str, Workload]:
    """train and serve on the GPU the kubelet gave each, sneak (no request) on a third; once
    each is marked with what its use deserves."""
    core: client.CoreV1Api = world.core
    node: Node = world.node
    ensure_namespace(core, NAMESPACE)
    _wait(
        "the namespace's ServiceAccount",
        lambda: core.read_namespaced_service_account("default", NAMESPACE),
    )
    apps = client.AppsV1Api(world.api)
    for name, gpus in (("train", 1), ("serve", 1), ("sneak", 0)):
        body: Any = sleeper_deployment(name, NAMESPACE, gpus, seconds=36000)
        apps.create_namespaced_deployment(NAMESPACE, body)
    pods = {
        name: _wait_running(core, NAMESPACE, f"app={name}") for name in ("train", "serve", "sneak")
    }
    socket = node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}
    devices = {
        name: given[pods[name].metadata.name].containers[0].devices[0].device_ids[0]
        for name in ("train", "serve")
    }
    spare = [g["uuid"] for g in node.scenario["gpus"] if g["uuid"] not in devices.values()]
    devices["sneak"] = spare[0]
    reasons = {"train": "ProcessesRunning", "serve": "ProcessesRunning"}
    work = {
        name: Workload(
            name=pod.metadata.name,
            namespace=NAMESPACE,
            uid=pod.metadata.uid,
            pid=node.host_pid(pod.status.container_statuses[0].container_id.split("://")[1]),
            device=devices[name],
            reason=reasons.get(name, "UsingUnrequestedGPU"),
            memory_mib=1024 * (i + 1),
        )
        for i, (name, pod) in enumerate(pods.items())
    }
    _write(world, work)
    for w in work.values():
        _wait_marked(core, w)
    return work


def _wait_running(core: client.CoreV1Api, namespace: str, selector: str) -> Any:
    return _wait(f"{selector} running", lambda: _running(core, namespace, selector))


def _wait_marked(core: client.CoreV1Api, work: Workload) -> None:
    _wait(f"{work.name} marked {work.reason}", lambda: _marked(core, work))


def _write(world: NodeWorld, work: dict[str, Workload]) -> None:
    processes: dict[str, list[dict[str, int]]] = {}
    for w in work.values():
        processes.setdefault(w.device, []).append({"pid": w.pid, "usedMemoryMiB": w.memory_mib})
    write_scenario(world.scenario, processes)


def _marked(core: client.CoreV1Api, work: Workload) -> bool:
    pod: Any = core.read_namespaced_pod(work.name, work.namespace)
    shown = {
        (c.status, c.reason)
        for c in pod.status.conditions or []
        if c.type == names.POD_CONDITION_GPU_IN_USE
    }
    annotations = pod.metadata.annotations or {}
    memory = annotations.get(names.ANNOTATION_GPU_MEMORY_MIB)
    right = _near(memory, work.memory_mib) or _held(annotations.get(names.ANNOTATION_USAGE))
    return shown == {("True", work.reason)} and right


def _near(shown: str | None, truth: int) -> bool:
    """Whether the pod's memory annotation is the truth as the operator shows it: within a
    step of it (writers.marks: smaller moves are not news on the pod; the status is exact)."""
    try:
        value = int(shown or "")
    except ValueError:
        return False
    return abs(value - truth) < max(MEMORY_STEP_MIB, MEMORY_STEP * value)


def _held(usage: str | None) -> bool:
    """Whether the pod's detail may still be held back (writers.marks.held_detail): it was
    observed less than DETAIL_EVERY ago (the status has the truth meanwhile)."""
    try:
        observed = datetime.fromisoformat(str(json.loads(usage or "")["observedAt"]))
    except (ValueError, KeyError, TypeError):
        return False
    return datetime.now(UTC) - observed < DETAIL_EVERY


# -- the faults: each returns the wall-clock time its part was back ------------------------
Fault = Callable[[NodeWorld, dict[str, Workload], random.Random | None], float]


def _part_back(world: NodeWorld, part: NodeComponent, away: float = 0.0) -> float:
    """The node's part crashed, away `away` seconds (the outage itself), started again; when
    the node was Ready with its devices."""
    node: Node = world.node
    node.restart(part, down_for=away)
    cluster = world.cluster
    node.wait_ready(cluster.binaries.kubectl, cluster.kubeconfig)
    return time.time()


def kubelet(world: NodeWorld, _: dict[str, Workload], rng: random.Random | None) -> float:
    away = KUBELET_AWAY_S if rng is None else rng.uniform(5, KUBELET_AWAY_S)
    return _part_back(world, "kubelet", away)


def containerd(world: NodeWorld, _: dict[str, Workload], __: random.Random | None) -> float:
    return _part_back(world, "containerd")


def device_plugin(world: NodeWorld, _: dict[str, Workload], __: random.Random | None) -> float:
    return _part_back(world, "device-plugin")


def _ready(core: client.CoreV1Api, part: str) -> Any:
    """The running pod of gpuusage-`part` once its container is ready, else None."""
    pod = _running(core, SYSTEM, f"app.kubernetes.io/name=gpuusage-{part}")
    return pod if _ready_since(pod) else None


def _ready_since(pod: Any) -> float | None:
    """When the pod's container last started, once it is ready."""
    status = (pod.status.container_statuses or [None])[0] if pod is not None else None
    if status is None or not status.ready or status.state.running is None:
        return None
    return float(status.state.running.started_at.timestamp())


def _replaced(core: client.CoreV1Api, part: str, old: Any) -> float:
    """When the pod that took the deleted `old` one's place had its container ready."""
    return float(
        _wait(
            f"a new {part} pod ready",
            lambda: (
                (new := _ready(core, part)) is not None
                and new.metadata.uid != old.metadata.uid
                and _ready_since(new)
            ),
        )
    )


def agent_pod_deleted(world: NodeWorld, _: dict[str, Workload], __: random.Random | None) -> float:
    core: client.CoreV1Api = world.core
    old = _wait("the agent ready", lambda: _ready(core, "agent"))
    core.delete_namespaced_pod(old.metadata.name, SYSTEM)
    return _replaced(core, "agent", old)


def agent_killed(world: NodeWorld, _: dict[str, Workload], __: random.Random | None) -> float:
    core: client.CoreV1Api = world.core
    pod = _wait("the agent ready", lambda: _ready(core, "agent"))
    status = pod.status.container_statuses[0]
    pid = world.node.host_pid(status.container_id.split("://")[1])
    os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer ends a container at its limit
    return float(
        _wait(
            "the agent's container restarted and ready",
            lambda: (
                (new := _ready(core, "agent")) is not None
                and new.status.container_statuses[0].restart_count > status.restart_count
                and _ready_since(new)
            ),
            timeout=400,  # the kubelet's crash-loop back-off reaches 5 minutes
        )
    )


def operator_killed_while_writing(
    world: NodeWorld, work: dict[str, Workload], __: random.Random | None
) -> float:
    """train's memory changes, and the operator's pod is killed at once: the write may be
    half done, or not begun; its successor must finish it."""
    core: client.CoreV1Api = world.core
    old = _wait("the operator ready", lambda: _ready(core, "operator"))
    train = work["train"]
    train.memory_mib = 3072 if train.memory_mib != 3072 else 1024
    _write(world, work)
    core.delete_namespaced_pod(old.metadata.name, SYSTEM, grace_period_seconds=0)
    return _replaced(core, "operator", old)


def apiserver(world: NodeWorld, _: dict[str, Workload], __: random.Random | None) -> float:
    world.cluster.restart("apiserver")
    return time.time()


FAULTS: dict[str, Fault] = {
    "kubelet": kubelet,
    "containerd": containerd,
    "device-plugin": device_plugin,
    "agent-pod-deleted": agent_pod_deleted,
    "agent-killed": agent_killed,
    "operator-killed-while-writing": operator_killed_while_writing,
    "apiserver": apiserver,
}


def fresh_after(world: NodeWorld, work: dict[str, Workload], back: float) -> float:
    """Seconds from `back` until the node is fresh: the agent's Lease renewed since, the
    report not stale and its kubelet read, every pod marked as its use deserves."""
    core: client.CoreV1Api = world.core
    custom = client.CustomObjectsApi(world.api)
    leases = client.CoordinationV1Api(world.api)
    since = datetime.fromtimestamp(back, UTC)

    waiting = ["nothing read yet"]

    def fresh() -> bool:
        lease: Any = leases.read_namespaced_lease(NODE, SYSTEM)
        if lease.spec.renew_time is None or lease.spec.renew_time <= since:
            waiting[0] = "the agent's Lease renewed"
            return False
        report: Any = custom.get_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, NODE
        )
        stale = [c for c in report["status"]["conditions"] if c["type"] == "Stale"]
        if not stale or stale[0]["status"] != "False":
            waiting[0] = f"the report not stale: {stale}"
            return False
        if report["spec"].get("kubelet", {}).get("state") != "Read":
            waiting[0] = f"the kubelet read: {report['spec'].get('kubelet')}"
            return False
        unmarked = [w.name for w in work.values() if not _marked(core, w)]
        if unmarked:
            waiting[0] = f"every pod marked, not {unmarked}"
            return False
        listed = {p["uid"]: p.get("usedMemoryMiB", 0) for p in report["status"].get("pods") or []}
        behind = [w.name for w in work.values() if listed.get(w.uid) != w.memory_mib]
        waiting[0] = f"the status's memory of every pod, not {behind}"
        return not behind

    try:
        _wait("the node fresh again", fresh, timeout=8 * LEASE_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: waiting for {waiting[0]}") from exc
    return time.time() - back


def run_node_soak(
    world: NodeWorld, work: dict[str, Workload], witness: Any, seconds: float, seed: int
) -> dict[str, Any]:
    """Faults at random (seeded) for `seconds`, each followed by the time to fresh; the
    witness's wrong marks at the end."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    faults: list[str] = []
    recovery: list[float] = []
    while time.monotonic() < end:
        name = rng.choice(sorted(FAULTS))
        back = FAULTS[name](world, work, rng)
        recovery.append(round(fresh_after(world, work, back), 2))
        faults.append(name)
    uses = {w.uid: w.reason for w in work.values()}
    ordered = sorted(recovery)
    return {
        "seed": seed,
        "seconds": seconds,
        "faults": faults,
        "recovery_s": recovery,
        "recovery_p50_s": round(statistics.median(ordered), 2) if ordered else None,
        "recovery_p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered
        else None,
        "wrong": witness.wrong_marks(uses, set(uses)),
    }


def main() -> int:
    from tests.witness import Witness  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=36)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gu-soak-") as tmp:
        worlds = installed_world(
            Path(tmp), agent_args=("--interval", "1", "--lease-duration", str(int(LEASE_S)))
        )
        world = next(worlds)
        try:
            work = put_to_work(world)
            witness = Witness(world.api, NAMESPACE).start()
            try:
                figures = run_node_soak(world, work, witness, args.minutes * 60, args.seed)
            finally:
                witness.stop()
        finally:
            worlds.close()
    print(json.dumps(figures, indent=2))
    return 0 if not figures["wrong"] else 1


if __name__ == "__main__":
    sys.exit(main())
