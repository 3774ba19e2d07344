"""`gpuusage demo`: the whole product on a local control plane, without a GPU or a cluster.

It starts etcd and kube-apiserver on loopback, installs the CRD, creates a simulated GPU node
with seven pods (their container IDs written into pod status, as a kubelet would), a GPU
scenario with a matching /proc tree (four GPUs: one time-sliced between a trainer, a notebook
that requested no GPU and a host process; one in MIG mode; one handed out by a DRA driver; one
shared by device-plugin pods and a fractional scheduler's pod), a DRA ResourceSlice and claim,
and a kubelet PodResources socket saying which device each device-plugin pod was given. It runs
the agent and the operator, shows what a person sees with kubectl, `gpuusage top`, `ps` and the
OpenReports (a pod
with no allocation, a pod on a device outside its allocation, a DRA pod, a fractional pod and a
notebook holding 70 GiB while computing nothing), ends one process to show the update, puts
two policies to work (a DryRun one for the idle notebook, an enforced one that evicts the pod
outside its allocation), and cleans up.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crds
from gpuusage.retry import poll_until
from gpuusage_commands.ps import PsSettings, run_ps
from gpuusage_commands.top import TopSettings, run_top
from gpuusage_dev.demopolicies import NOTICE, show_policies
from gpuusage_dev.demoreports import install_openreports, show_reports
from gpuusage_dev.fakekubelet import FakeKubelet
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.proctree import pod_cgroup, write_process
from gpuusage_dev.simulation import (
    Background,
    create_allocated_claim,
    create_gpu_slice,
    create_running_pod,
    ensure_namespace,
)
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.main import run_operator
from gpuusage_operator.settings import OperatorSettings

DEMO_NODE = "gpu-node-a"
DEMO_NAMESPACE = "gpuusage-system"  # where the agent renews its Lease
GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-66666666-7777-8888-9999-000000000000"
GPU2 = "GPU-22222222-3333-4444-5555-666666666666"
GPU3 = "GPU-33333333-4444-5555-6666-777777777777"
MIG0 = "MIG-4f1d2c3b-5a6e-4d7c-8b9a-0f1e2d3c4b5a"
IDLE_AFTER = 6.0
"""Seconds (the operator's --idle-after; 30 minutes by default) before idleness is flagged."""


@dataclass(frozen=True)
class DemoPod:
    namespace: str
    name: str
    container: str
    pid: int
    comm: str
    gpus: int
    """nvidia.com/gpu requested."""
    kubelet: tuple[str, ...] = ()
    """Device IDs the kubelet's device plugin gave it."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Annotations or claims (see create_running_pod)."""


PODS = (
    DemoPod("ml-team", "train-0", "trainer", 4242, "python", 1, (f"{GPU0}::0",)),
    # Requests no GPU: reaches one through NVIDIA_VISIBLE_DEVICES=all (UsingUnrequestedGPU).
    DemoPod("research", "notebook", "jupyter", 5151, "ipykernel", 0),
    DemoPod("serving", "triton", "server", 6262, "tritonserver", 1, (MIG0,)),
    # Its DRA claim got GPU2.
    DemoPod("vision", "segment-0", "segmenter", 7373, "python", 0, (), {"claims": {"gpu": "seg"}}),
    # The device plugin gave it a replica of GPU3; it runs on GPU2 (UsingUnallocatedGPU).
    DemoPod("ml-team", "train-1", "trainer", 8484, "python", 1, (f"{GPU3}::1",)),
    # A fractional scheduler gave it half a GPU.
    DemoPod(
        "inference",
        "shared-llm",
        "server",
        9595,
        "vllm",
        0,
        (),
        {"annotations": {"gpu-fraction": "0.5"}},
    ),
    # A notebook kernel keeping 70 GiB and computing nothing (HoldingIdleGPU).
    DemoPod("research", "lab", "jupyter", 5252, "ipykernel", 1, (f"{GPU3}::0",)),
)


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def _gpu(index: int, uuid: str, name: str, processes: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "memoryTotalMiB": 81920,
        "processes": processes,
    }


def _scenario(path: Path, notebook_running: bool) -> None:
    gpu0 = [
        {"pid": 4242, "usedMemoryMiB": 30720, "name": "python", "smUtil": 85},
        {
            "pid": 777,
            "usedMemoryMiB": 512,
            "name": "Xorg",
            "types": ["graphics"],
            "smUtil": 2,
            "duty": 0.05,
        },
    ]
    if notebook_running:
        notebook = {"pid": 5151, "usedMemoryMiB": 10240, "name": "ipykernel", "smUtil": 30}
        gpu0.insert(1, {**notebook, "duty": NOTEBOOK_DUTY})
    h100 = "NVIDIA H100 80GB HBM3"
    scenario = {
        "driverVersion": "550.54.15",
        "cudaVersion": "12.4",
        "gpus": [
            {
                **_gpu(0, GPU0, "NVIDIA A100-SXM4-80GB", gpu0),
                "utilization": {"gpu": 87, "memory": 41},
            },
            {
                **_gpu(1, GPU1, "NVIDIA A100-SXM4-80GB", []),
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
            _gpu(
                2,
                GPU2,
                h100,
                [
                    {"pid": 7373, "usedMemoryMiB": 24576, "name": "python", "smUtil": 60},
                    {"pid": 8484, "usedMemoryMiB": 16384, "name": "python", "smUtil": 90},
                ],
            ),
            _gpu(
                3,
                GPU3,
                h100,
                [
                    {"pid": 9595, "usedMemoryMiB": 8192, "name": "vllm", "smUtil": 40},
                    {"pid": 5252, "usedMemoryMiB": 71680, "name": "ipykernel", "smUtil": 0},
                ],
            ),
        ],
    }
    fresh = path.with_suffix(".new")  # atomically: the agent re-reads the file every cycle
    fresh.write_text(yaml.safe_dump(scenario, sort_keys=False))
    fresh.replace(path)


def _kubelet_answer(kubelet: FakeKubelet) -> None:
    """What the kubelet's PodResources API says each device-plugin pod was given."""
    kubelet.pods(
        *(
            {
                "name": pod.name,
                "namespace": pod.namespace,
                "containers": [
                    {
                        "name": pod.container,
                        "devices": [
                            {"resource_name": "nvidia.com/gpu", "device_ids": list(pod.kubelet)}
                        ],
                    }
                ],
            }
            for pod in PODS
            if pod.kubelet
        )
    )


NOTEBOOK_DUTY = 0.3
"""The notebook computes a third of the time on the trainer's GPU: who gets its compute?"""
SHARE_SETTINGS = {"share_window": 30.0, "share_read_every": 0.5}
"""The agent's share window in the demos: short, so the shares show within half a minute
(after 15 s), read often enough to be within a few points by then."""


def shares_told(api: client.ApiClient, pods: set[str]) -> bool:
    """Whether the demo node's report gives each of these pods its share of its GPU."""
    raw: Any = client.CustomObjectsApi(api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, DEMO_NODE
    )
    listed = (raw.get("status") or {}).get("pods") or []
    return pods <= {p["name"] for p in listed if p.get("computeShare") is not None}


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    if not poll_until(predicate, timeout, 0.3):
        raise TimeoutError(f"demo: timed out waiting for {what}")


def run_demo(directory: Path | None, keep: bool = False) -> int:
    workdir = directory or Path(tempfile.mkdtemp(prefix="gpuusage-demo-"))
    for noisy in ("gpuusage_nodeagent", "gpuusage_operator", "gpuusage.kube"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("kopf").setLevel(logging.ERROR)  # it warns that it runs in a thread
    cluster = LocalCluster(workdir / "cluster")
    step(f"starting a local control plane in {cluster.directory} (etcd + kube-apiserver)")
    cluster.up()
    running: list[Background] = []
    kubelet: FakeKubelet | None = None
    try:
        api, _ = api_client(cluster.kubeconfig)
        core = client.CoreV1Api(api)
        events = client.EventsV1Api(api)
        step("installing the GpuNodeUsage CRD, and the OpenReports API's (where findings go)")
        install_crds(api)
        kubectl = [str(cluster.binaries.kubectl), f"--kubeconfig={cluster.kubeconfig}"]
        install_openreports(kubectl)

        step(
            f"simulating node {DEMO_NODE}: {len(PODS)} pods, 4 GPUs (one time-sliced, one in MIG "
            "mode, one handed out by a DRA driver, one shared)"
        )
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=DEMO_NODE)))
        proc = workdir / "proc"
        for pod in PODS:
            ensure_namespace(core, pod.namespace)
            uid, cid = create_running_pod(
                core, pod.namespace, pod.name, DEMO_NODE, pod.container, gpus=pod.gpus, **pod.extras
            )
            write_process(proc, pod.pid, pod_cgroup(uid, cid), comm=pod.comm, start_ticks=pod.pid)
            where = f"{pod.namespace}/{pod.name}"
            print(f"    pod {where}: container {pod.container} ({cid[:12]}), pid {pod.pid}")
        write_process(proc, 777, "0::/system.slice/display-manager.service", comm="Xorg")
        print("    host process Xorg, pid 777, outside any pod")
        resource = client.ResourceV1Api(api)
        create_gpu_slice(resource, DEMO_NODE, [{"name": "gpu-2", "type": "gpu", "uuid": GPU2}])
        create_allocated_claim(resource, "vision", "seg", DEMO_NODE, ["gpu-2"])
        print(
            f"    DRA: gpu.nvidia.com's ResourceSlice lists gpu-2 ({GPU2}); claim vision/seg got it"
        )
        scenario = workdir / "gpus.yaml"
        _scenario(scenario, notebook_running=True)
        kubelet = FakeKubelet(workdir / "pod-resources" / "kubelet.sock")
        _kubelet_answer(kubelet)
        kubelet.start()
        print(f"    kubelet PodResources socket at {kubelet.socket}")

        step(
            "starting the operator and the node agent (its liveness: a Lease in "
            f"{DEMO_NAMESPACE}, renewed every few seconds; the report is written on change)"
        )
        ensure_namespace(core, DEMO_NAMESPACE)
        ready = threading.Event()
        op = OperatorSettings(
            kubeconfig=cluster.kubeconfig,
            stale_after=30,
            resync=1,
            standalone=True,
            idle_after=IDLE_AFTER,
            lease_namespace=DEMO_NAMESPACE,
            policy_notice=NOTICE,
            policy_actions=True,
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
            idle_window=2,
            **SHARE_SETTINGS,
            pod_resources_socket=kubelet.socket,
            lease_namespace=DEMO_NAMESPACE,
            lease_duration=20,
        )
        running.append(Background(lambda stop: run_agent(agent, stop)))

        def annotated(namespace: str, pod: str) -> bool:
            meta = core.read_namespaced_pod(pod, namespace).metadata
            return bool(meta and names.ANNOTATION_GPUS in (meta.annotations or {}))

        def reason(namespace: str, pod: str) -> str | None:
            status = core.read_namespaced_pod(pod, namespace).status
            found = [
                c.reason
                for c in (status.conditions if status else None) or []
                if c.type == names.POD_CONDITION_GPU_IN_USE
            ]
            return found[0] if found else None

        _wait(lambda: all(annotated(p.namespace, p.name) for p in PODS), "pod annotations")
        _wait(lambda: reason("ml-team", "train-1") == "UsingUnallocatedGPU", "train-1's finding")
        print(
            f"    (the lab notebook computes nothing; flagged after --idle-after={IDLE_AFTER:g}s)"
        )
        _wait(lambda: reason("research", "lab") == "HoldingIdleGPU", "the idle notebook's finding")
        print("    (train-0 and the notebook share a GPU: their shares of its time take 15 s)")
        _wait(lambda: shares_told(api, {"train-0", "notebook"}), "the shared GPU's shares")
        show(kubectl, detail=True)
        step("who holds the GPU memory, and who gets the compute (COMPUTE: share of GPU time)")
        print("\n$ gpuusage top -A     # also: kubectl gpuusage top -A", flush=True)
        run_top(TopSettings(kubeconfig=cluster.kubeconfig, all_namespaces=True))
        print(
            "\n$ gpuusage top --by namespace   # now; with --window 24h --prometheus URL: hours",
            flush=True,
        )
        run_top(TopSettings(kubeconfig=cluster.kubeconfig, by="namespace"))
        print("\n$ gpuusage ps -A      # every GPU process, as nvidia-smi lists them", flush=True)
        run_ps(PsSettings(kubeconfig=cluster.kubeconfig, all_namespaces=True))
        show_reports(step, kubectl, api)

        step("the notebook's kernel exits (the scenario changes)")
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
        show(kubectl, detail=False)
        show_policies(step, kubectl, api, cluster.kubeconfig)
    finally:
        for background in reversed(running):
            background.halt()
        if kubelet is not None:
            kubelet.stop()
        if keep:
            print(f"\ncluster left running; export KUBECONFIG={cluster.kubeconfig}")
            print(f"stop it with: gpuusage local-cluster down --dir {cluster.directory}")
        else:
            step("stopping the local control plane")
            cluster.down()
    return 0


def show(kubectl: list[str], detail: bool) -> None:
    def run(*args: str) -> None:
        print(f"\n$ kubectl {' '.join(args)}", flush=True)
        subprocess.run([*kubectl, *args], check=False)

    condition = f'.status.conditions[?(@.type=="{names.POD_CONDITION_GPU_IN_USE}")]'
    escaped = names.GROUP.replace(".", "\\.")
    if detail:
        step("what kubectl shows")
        run("get", "gpunodeusage", "-o", "wide")
        stale = f'.status.conditions[?(@.type=="{names.CONDITION_STALE}")]'
        run("get", "lease", "-n", DEMO_NAMESPACE)
        run(
            "get",
            "gpunodeusage",
            DEMO_NODE,
            "-o",
            f"jsonpath=Stale={{{stale}.status}} {{{stale}.reason}}: {{{stale}.message}}{{'\\n'}}",
        )
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
        step("allocated against used, per device (DRA claims, the kubelet, a share of its time)")
        run(
            "get",
            "gpunodeusage",
            DEMO_NODE,
            "-o",
            "jsonpath={range .status.pods[*]}{.namespace}/{.name}{'\\t'}uses {.deviceUUID}"
            "{'\\t'}allocatedBy={.allocatedBy}{'\\t'}allocated={.allocatedDevices}"
            "{'\\t'}unallocated={.unallocated}{'\\t'}heldIdleSince={.heldIdleSince}"
            "{'\\t'}computeShare={.computeShare}{'\\t'}handedShare={.handedShare}{'\\n'}{end}",
        )
        for namespace, pod in (("ml-team", "train-1"), ("research", "lab")):
            run(
                "get",
                "pod",
                pod,
                "-n",
                namespace,
                "-o",
                f"jsonpath={{{condition}.message}}{{'\\n'}}",
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
