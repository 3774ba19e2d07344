"""Fault soak: the apiserver killed and restarted again and again while GPU use changes, then
every mark gpuusage wrote compared with the truth.

One simulated GPU node with six pods, the real agent and the real operator, on a real local
control plane. Each round, while the apiserver is down, processes end and start and memory
moves; right after the apiserver is back, pods are deleted and recreated under the same name
(new UID, new container, new process), before the operator's pod watch has listed again. Then
the checker waits until every pod's annotations and condition, and the report's status, say
exactly what the scenario says, and records how long that took. A mark that is still wrong when
the round's time is up counts as wrong; an agent or operator thread that died counts as a crash.

    python benchmarks/fault_soak.py --rounds 10          # the soak (figures in README.md)

`tests/test_fault_soak.py` runs two rounds on the test session's control plane.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the tests package; gpuusage is installed

from gpuusage.api import names  # noqa: E402
from gpuusage.kube.config import api_client  # noqa: E402
from gpuusage.kube.crds import install_crds  # noqa: E402
from gpuusage_dev.localcluster.cluster import LocalCluster  # noqa: E402
from gpuusage_dev.proctree import pod_cgroup, write_process  # noqa: E402
from gpuusage_dev.simulation import Background, create_running_pod, ensure_namespace  # noqa: E402
from gpuusage_nodeagent.main import run_agent  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402
from gpuusage_operator.main import run_operator  # noqa: E402
from gpuusage_operator.settings import OperatorSettings  # noqa: E402

GPUS = ("GPU-50a4c0de-0000-4000-8000-000000000000", "GPU-50a4c0de-0000-4000-8000-000000000001")
PODS = ("train-0", "train-1", "train-2", "notebook", "infer-0", "infer-1")


@dataclass
class Use:
    """The truth about one pod: who it is and what its process uses (mib None: no process)."""

    uid: str
    cid: str
    pid: int
    gpu: str
    mib: int | None


@dataclass
class Round:
    converged_s: float | None
    wrong: list[str]
    recreated: int
    changes: int


@dataclass
class Node:
    """The simulated node: pods, their processes in a proc tree, and the scenario file."""

    core: client.CoreV1Api
    ns: str
    name: str
    proc: Path
    scenario: Path
    uses: dict[str, Use] = field(default_factory=dict)
    next_pid: int = 20_000

    def create(self, pod: str, gpu: str, mib: int | None) -> None:
        uid, cid = create_running_pod(
            self.core, self.ns, pod, self.name, pod.split("-", maxsplit=1)[0]
        )
        self.next_pid += 1
        write_process(self.proc, self.next_pid, pod_cgroup(uid, cid), start_ticks=self.next_pid)
        self.uses[pod] = Use(uid, cid, self.next_pid, gpu, mib)

    def write_scenario(self) -> None:
        gpus = []
        for index, gpu in enumerate(GPUS):
            procs = [
                {"pid": u.pid, "usedMemoryMiB": u.mib}
                for u in self.uses.values()
                if u.gpu == gpu and u.mib is not None
            ]
            gpus.append({"index": index, "uuid": gpu, "memoryTotalMiB": 81920, "processes": procs})
        fresh = self.scenario.with_suffix(".new")
        fresh.write_text(yaml.safe_dump({"gpus": gpus}))
        fresh.replace(self.scenario)


def wrong_marks(node: Node, custom: client.CustomObjectsApi) -> list[str]:
    """Every difference between what gpuusage wrote and the truth (empty: all true)."""
    wrong = []
    for name, use in node.uses.items():
        pod = node.core.read_namespaced_pod(name, node.ns)
        annotations = (pod.metadata.annotations if pod.metadata else None) or {}
        ours = {k: v for k, v in annotations.items() if k.startswith(names.GROUP)}
        conditions = (pod.status.conditions if pod.status else None) or []
        condition = next((c for c in conditions if c.type == names.POD_CONDITION_GPU_IN_USE), None)
        state = f"{condition.status} {condition.reason}" if condition else "none"
        if use.mib is not None:
            # (the memory is the status's to tell exactly, below: the pod's moves in steps)
            want = {names.ANNOTATION_GPUS: use.gpu}
            got = {k: ours.get(k) for k in want}
            if got != want or state != "True ProcessesRunning":
                wrong.append(f"{name}: {got} {state}, want {want} True")
        elif ours or state not in ("none", "False ProcessesEnded"):
            wrong.append(f"{name}: {sorted(ours)} {state}, want no marks")
    report = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, node.name)
    assert isinstance(report, dict)
    status = report.get("status") or {}
    listed = {(p["name"], p["uid"], p.get("usedMemoryMiB", 0)) for p in status.get("pods") or []}
    truth = {(n, u.uid, u.mib) for n, u in node.uses.items() if u.mib is not None}
    if listed != truth:
        wrong.append(f"report status lists {sorted(listed)}, want {sorted(truth)}")
    return wrong


Converged = tuple[float | None, list[str]]


def _converge(node: Node, custom: client.CustomObjectsApi, timeout: float) -> Converged:
    started = time.monotonic()
    wrong: list[str] = ["not checked"]
    while time.monotonic() - started < timeout:
        try:
            wrong = wrong_marks(node, custom)
        except Exception as exc:  # the API still coming back
            wrong = [f"cannot check: {exc}"]
        if not wrong:
            return time.monotonic() - started, []
        time.sleep(0.2)
    return None, wrong


def run_soak(
    cluster: LocalCluster, rounds: int, seed: int, work: Path, *, timeout: float = 90.0
) -> dict[str, Any]:
    """Run the soak on a running cluster; the figures as a dict."""
    rng = random.Random(seed)
    admin, _ = api_client(cluster.kubeconfig)
    core, custom = client.CoreV1Api(admin), client.CustomObjectsApi(admin)
    suffix = uuid.uuid4().hex[:6]
    node = Node(core, f"soak-{suffix}", f"soak-node-{suffix}", work / "proc", work / "gpus.yaml")
    ensure_namespace(core, node.ns)
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node.name)))
    for index, pod in enumerate(PODS):
        node.create(pod, GPUS[index % 2], 1024 * (index + 1))
    node.write_scenario()
    agent = Background(
        lambda stop: run_agent(
            AgentSettings(
                node_name=node.name,
                interval=0.5,
                heartbeat=2.0,
                gpu_source=f"fake:{node.scenario}",
                proc_root=node.proc,
                kubeconfig=cluster.kubeconfig,
                metrics_port=0,
            ),
            stop,
        )
    )
    ready = threading.Event()
    operator = Background(
        lambda stop: run_operator(
            OperatorSettings(
                kubeconfig=cluster.kubeconfig, standalone=True, stale_after=60.0, resync=1.0
            ),
            stop,
            ready,
        )
    )
    results: list[Round] = []
    try:
        if not ready.wait(60):
            raise RuntimeError("the operator did not start")
        first, wrong = _converge(node, custom, timeout)
        if first is None:
            raise RuntimeError(f"never converged before the faults: {wrong}")
        for _ in range(rounds):
            cluster.stop("apiserver")
            changes = 0
            for use in node.uses.values():  # processes end and start, memory moves
                roll = rng.random()
                if roll < 0.25:
                    use.mib = None if use.mib is not None else 2048
                    changes += 1
                elif roll < 0.5 and use.mib is not None:
                    use.mib += rng.choice((-512, 512, 4096))
                    changes += 1
            node.write_scenario()
            time.sleep(rng.uniform(1.0, 3.0))  # the outage: the agent cannot publish meanwhile
            cluster.start("apiserver")
            recreated = rng.sample(list(node.uses), k=2)  # a StatefulSet replaces its pods
            for name in recreated:
                gpu, mib = node.uses[name].gpu, node.uses[name].mib
                core.delete_namespaced_pod(name, node.ns, grace_period_seconds=0)
                node.create(name, gpu, mib)
            node.write_scenario()
            took, wrong = _converge(node, custom, timeout)
            results.append(Round(took, wrong, len(recreated), changes))
    finally:
        crashed = [
            n for n, b in (("agent", agent), ("operator", operator)) if not b.thread.is_alive()
        ]
        agent.halt()
        operator.halt()
        admin.close()  # type: ignore[no-untyped-call]
    times = [r.converged_s for r in results if r.converged_s is not None]
    return {
        "rounds": rounds,
        "apiserver_restarts": rounds,
        "pods_recreated": sum(r.recreated for r in results),
        "use_changes": sum(r.changes for r in results),
        "wrong_marks": sum(len(r.wrong) for r in results),
        "wrong": [w for r in results for w in r.wrong],
        "crashed": crashed,
        "converge_s": [round(t, 1) for t in times],
        "converge_s_max": round(max(times), 1) if times else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuusage-soak-") as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", tie_to_parent=True)
        cluster.up()
        try:
            api, _ = api_client(cluster.kubeconfig)
            with api:
                install_crds(api)
            figures = run_soak(cluster, args.rounds, args.seed, Path(tmp))
        finally:
            cluster.down()
    print(json.dumps(figures, indent=2))
    return 0 if figures["wrong_marks"] == 0 and not figures["crashed"] else 1


if __name__ == "__main__":
    sys.exit(main())
