"""`gpuusage demo`: the whole product on a local control plane, without a GPU or a cluster.

It starts etcd and kube-apiserver on loopback, installs the CRD, creates a simulated GPU node
with three pods (their container IDs written into pod status, as a kubelet would), a GPU
scenario (two A100s: one time-sliced between two pods plus a host process, one in MIG mode)
with a matching /proc tree, runs the agent and the operator, shows what a person sees with
kubectl, ends one process to show the update, and cleans up.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crds
from gpuusage.retry import poll_until
from gpuusage_commands.top import TopSettings, run_top
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import (
    Background,
    create_running_pod,
    ensure_namespace,
    pod_cgroup,
    write_process,
)
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.main import run_operator
from gpuusage_operator.settings import OperatorSettings

DEMO_NODE = "gpu-node-a"
GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-66666666-7777-8888-9999-000000000000"
MIG0 = "MIG-4f1d2c3b-5a6e-4d7c-8b9a-0f1e2d3c4b5a"
# (namespace, pod, container, pid, process name, GPUs requested). The notebook requests none:
# it reaches the GPU through NVIDIA_VISIBLE_DEVICES=all, which the operator flags.
PODS = (
    ("ml-team", "train-0", "trainer", 4242, "python", 1),
    ("research", "notebook", "jupyter", 5151, "ipykernel", 0),
    ("serving", "triton", "server", 6262, "tritonserver", 1),
)


def _step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def _scenario(path: Path, notebook_running: bool) -> None:
    gpu0 = [
        {"pid": 4242, "usedMemoryMiB": 30720, "name": "python"},
        {"pid": 777, "usedMemoryMiB": 512, "name": "Xorg", "types": ["graphics"]},
    ]
    if notebook_running:
        gpu0.insert(1, {"pid": 5151, "usedMemoryMiB": 10240, "name": "ipykernel"})
    scenario = {
        "driverVersion": "550.54.15",
        "cudaVersion": "12.4",
        "gpus": [
            {
                "index": 0,
                "uuid": GPU0,
                "name": "NVIDIA A100-SXM4-80GB",
                "memoryTotalMiB": 81920,
                "utilization": {"gpu": 87, "memory": 41},
                "processes": gpu0,
            },
            {
                "index": 1,
                "uuid": GPU1,
                "name": "NVIDIA A100-SXM4-80GB",
                "memoryTotalMiB": 81920,
                "migDevices": [
                    {
                        "index": 0,
                        "uuid": MIG0,
                        "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                        "memoryTotalMiB": 40192,
                        "processes": [{"pid": 6262, "usedMemoryMiB": 20480}],
                    }
                ],
            },
        ],
    }
    fresh = path.with_suffix(".new")  # atomically: the agent re-reads the file every cycle
    fresh.write_text(yaml.safe_dump(scenario, sort_keys=False))
    fresh.replace(path)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    if not poll_until(predicate, timeout, 0.3):
        raise TimeoutError(f"demo: timed out waiting for {what}")


def run_demo(directory: Path | None, keep: bool = False) -> int:
    workdir = directory or Path(tempfile.mkdtemp(prefix="gpuusage-demo-"))
    for noisy in ("gpuusage_nodeagent", "gpuusage_operator", "gpuusage.kube"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("kopf").setLevel(logging.ERROR)  # it warns that it runs in a thread
    cluster = LocalCluster(workdir / "cluster")
    _step(f"starting a local control plane in {cluster.directory} (etcd + kube-apiserver)")
    cluster.up()
    running: list[Background] = []
    try:
        api, _ = api_client(cluster.kubeconfig)
        core = client.CoreV1Api(api)
        events = client.EventsV1Api(api)
        _step("installing the GpuNodeUsage CRD")
        install_crds(api)

        _step(f"simulating node {DEMO_NODE}: 3 pods, 2 A100s (one time-sliced, one in MIG mode)")
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=DEMO_NODE)))
        proc = workdir / "proc"
        for namespace, pod, container, pid, comm, gpus in PODS:
            ensure_namespace(core, namespace)
            uid, cid = create_running_pod(core, namespace, pod, DEMO_NODE, container, gpus=gpus)
            write_process(proc, pid, pod_cgroup(uid, cid), comm=comm, start_ticks=pid)
            print(f"    pod {namespace}/{pod}: container {container} ({cid[:12]}), pid {pid}")
        write_process(proc, 777, "0::/system.slice/display-manager.service", comm="Xorg")
        print("    host process Xorg, pid 777, outside any pod")
        scenario = workdir / "gpus.yaml"
        _scenario(scenario, notebook_running=True)

        _step("starting the operator and the node agent")
        ready = threading.Event()
        op = OperatorSettings(
            kubeconfig=cluster.kubeconfig, stale_after=30, resync=1, standalone=True
        )
        running.append(Background(lambda stop: run_operator(op, stop, ready)))
        if not ready.wait(60):
            raise TimeoutError("demo: the operator did not start")
        agent = AgentSettings(
            node_name=DEMO_NODE,
            interval=1,
            heartbeat=10,
            gpu_source=f"fake:{scenario}",
            proc_root=proc,
            kubeconfig=cluster.kubeconfig,
            metrics_port=0,
        )
        running.append(Background(lambda stop: run_agent(agent, stop)))

        def annotated(namespace: str, pod: str) -> bool:
            meta = core.read_namespaced_pod(pod, namespace).metadata
            return bool(meta and names.ANNOTATION_GPUS in (meta.annotations or {}))

        _wait(lambda: all(annotated(ns, pod) for ns, pod, *_ in PODS), "pod annotations")
        kubectl = [str(cluster.binaries.kubectl), f"--kubeconfig={cluster.kubeconfig}"]
        _show(kubectl, detail=True)
        _step("who holds the GPU memory")
        print("\n$ gpuusage top -A     # also: kubectl gpuusage top -A", flush=True)
        run_top(TopSettings(kubeconfig=cluster.kubeconfig, all_namespaces=True))

        _step("the notebook's kernel exits (the scenario changes)")
        _scenario(scenario, notebook_running=False)

        def ended(namespace: str, pod: str) -> bool:
            """The pod's annotations are gone and the end of its use is recorded as an Event
            (written after the condition), so that what is shown next is complete."""
            listed = events.list_namespaced_event(namespace).items
            return not annotated(namespace, pod) and any(
                e.reason == "GPUUseEnded" and e.regarding and e.regarding.name == pod
                for e in listed
            )

        _wait(lambda: ended("research", "notebook"), "the notebook's use to end")
        _show(kubectl, detail=False)
    finally:
        for background in reversed(running):
            background.halt()
        if keep:
            print(f"\ncluster left running; export KUBECONFIG={cluster.kubeconfig}")
            print(f"stop it with: gpuusage local-cluster down --dir {cluster.directory}")
        else:
            _step("stopping the local control plane")
            cluster.down()
    return 0


def _show(kubectl: list[str], detail: bool) -> None:
    def run(*args: str) -> None:
        print(f"\n$ kubectl {' '.join(args)}", flush=True)
        subprocess.run([*kubectl, *args], check=False)

    condition = f'.status.conditions[?(@.type=="{names.POD_CONDITION_GPU_IN_USE}")]'
    escaped = names.GROUP.replace(".", "\\.")
    if detail:
        _step("what kubectl shows")
        run("get", "gpunodeusage", "-o", "wide")
    run(
        "get",
        "pods",
        "-A",
        "-o",
        "custom-columns=NAMESPACE:.metadata.namespace,POD:.metadata.name,"
        f"GPUS:.metadata.annotations.{escaped}/gpus,"
        f"MEMORY-MIB:.metadata.annotations.{escaped}/gpu-memory-mib,"
        f"GPU-IN-USE:{condition}.status,REASON:{condition}.reason",
    )
    if detail:
        run(
            "get",
            "pod",
            "train-0",
            "-n",
            "ml-team",
            "-o",
            f"jsonpath={{.metadata.annotations.{escaped}/usage}}{{'\\n'}}"
            f"{{{condition}.message}}{{'\\n'}}",
        )
    run(
        "get",
        "events",
        "-A",
        "--field-selector",
        "reportingComponent=gpuusage.io/operator",
        "-o",
        "custom-columns=NAMESPACE:.metadata.namespace,POD:.involvedObject.name,"
        "REASON:.reason,MESSAGE:.message",
    )
