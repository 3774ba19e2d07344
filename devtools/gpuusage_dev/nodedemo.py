"""`gpuusage demo` on a real node: the product installed as users install it, marking real pods.

Where this machine can run a node (root, containerd, runc; see localcluster.node), the demo
starts the local control plane with a real kubelet, containerd and our device plugin, builds
and imports the product's images, installs them with `kubectl apply -k` (the agent as its
DaemonSet's pod, the operator as its Deployment), and runs four real pods. The GPUs are the one
simulated part: a scenario file names the pods' real host pids on the devices the kubelet gave
them, or on others:

- ml-team/train-0 (asked for 1 GPU) computes on the GPU the kubelet gave it;
- research/notebook asked for none and runs on train-0's GPU (NVIDIA_VISIBLE_DEVICES=all);
- ml-team/train-1 was given one GPU and runs on another;
- research/lab holds 70 GiB of its GPU and computes nothing.

Then two policies, installed with the policy-actions part: a DryRun one for idle GPUs in
research (it records that it would delete the lab pod, and leaves it running) and an enforced
one for misuse in ml-team (it evicts train-1, which runs on a GPU it was not given), each
announced on the pod first.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_commands.ps import PsSettings, run_ps
from gpuusage_commands.top import TopSettings, run_top
from gpuusage_dev.demo import (
    DEMO_NODE,
    IDLE_AFTER,
    NOTEBOOK_DUTY,
    SHARE_SETTINGS,
    shares_told,
    show,
    step,
)
from gpuusage_dev.demopolicies import NOTICE, show_policies, wait_until
from gpuusage_dev.demoreports import install_openreports, show_reports
from gpuusage_dev.localcluster.node import DEFAULT_SCENARIO, running_node, write_scenario
from gpuusage_dev.localcluster.nodeinstall import overlay
from gpuusage_dev.localcluster.workloads import sleeper_pod
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.podresources.kubelet import list_pods
from gpuusage_nodeagent.podresources.wire import list_response

PODS = (  # namespace, name, GPUs requested
    ("ml-team", "train-0", 1),
    ("research", "notebook", 0),
    ("ml-team", "train-1", 1),
    ("research", "lab", 1),
)


def run_node_demo(directory: Path | None, keep: bool = False) -> int:
    workdir = directory or Path(tempfile.mkdtemp(prefix="gpuusage-demo-"))
    scenario = workdir / "scenario"
    scenario.mkdir(parents=True, exist_ok=True)
    write_scenario(scenario, {})
    step(
        f"starting a local control plane and a real node {DEMO_NODE} in {workdir}: kubelet, "
        "containerd, runc, a CNI bridge, our device plugin with 4 GPUs (building the product's "
        "images the first time)"
    )
    with running_node(workdir, DEMO_NODE, product=True) as (cluster, node):
        kubectl = [str(cluster.binaries.kubectl), f"--kubeconfig={cluster.kubeconfig}"]
        folder = overlay(
            workdir / "install",
            apiserver_port=int(cluster.server.rsplit(":", 1)[1]),
            scenario_dir=scenario,
            kubelet_root=node.directory / "kubelet",
            agent_args=(
                *("--interval", "1", "--idle-window", "2"),
                *("--share-window", f"{SHARE_SETTINGS['share_window']:g}"),
                *("--share-read-every", f"{SHARE_SETTINGS['share_read_every']:g}"),
            ),
            operator_args=(f"--idle-after={IDLE_AFTER:g}", f"--policy-notice={NOTICE:g}"),
            base="manifests/overlays/policy-actions",
        )
        step("installing gpuusage as users do: kubectl apply -k (the GPUs come from a scenario)")
        install_openreports(kubectl)  # where its findings go, as a policy tool's install brings
        subprocess.run([*kubectl, "apply", "-k", str(folder)], check=True)
        api, _ = api_client(cluster.kubeconfig)
        core = client.CoreV1Api(api)
        step("four real pods, run by the kubelet with containerd and runc")
        for namespace, name, gpus in PODS:
            ensure_namespace(core, namespace)
            wait_until(_account(core, namespace), f"namespace {namespace}'s service account")
            pod: Any = sleeper_pod(namespace, name, gpus)  # the client sends a dict as it is
            core.create_namespaced_pod(namespace, pod)
        for namespace, name, _ in PODS:
            wait_until(_phase(core, namespace, name, "Running"), f"{namespace}/{name} running")
        socket = node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
        given = {
            p.name: p.containers[0].devices[0].device_ids[0]
            for p in list_response(list_pods(socket, 5))
            if p.containers and p.containers[0].devices
        }
        pids = {}
        for namespace, name, _ in PODS:
            status: Any = core.read_namespaced_pod(name, namespace).status
            cid = status.container_statuses[0].container_id.split("://", 1)[1]
            pids[name] = node.host_pid(cid)
            device = given.get(name, "none: it asked for no GPU")
            print(f"    {namespace}/{name}: host pid {pids[name]}, kubelet gave it {device}")
        free = [g["uuid"] for g in DEFAULT_SCENARIO["gpus"] if g["uuid"] not in given.values()]
        elsewhere = free[0] if free else given["train-0"]

        def use(notebook: bool) -> dict[str, list[dict[str, Any]]]:
            used: dict[str, list[dict[str, Any]]] = {}

            def put(device: str, pid: int, mib: int, sm: int, duty: float = 1.0) -> None:
                process = {"pid": pid, "usedMemoryMiB": mib, "smUtil": sm}
                used.setdefault(device, []).append(process | ({"duty": duty} if sm else {}))

            put(given["train-0"], pids["train-0"], 30720, 87)
            if notebook:
                put(given["train-0"], pids["notebook"], 10240, 12, NOTEBOOK_DUTY)
            put(elsewhere, pids["train-1"], 20480, 64)
            put(given["lab"], pids["lab"], 71680, 0)
            return used

        step(
            "the scenario puts their real pids on the GPUs: train-1 on a GPU the kubelet did "
            f"not give it ({elsewhere})"
        )
        write_scenario(scenario, use(notebook=True))

        def reason(namespace: str, name: str) -> str | None:
            status: Any = core.read_namespaced_pod(name, namespace).status
            found = [
                c.reason
                for c in status.conditions or []
                if c.type == names.POD_CONDITION_GPU_IN_USE
            ]
            return found[0] if found else None

        wait_until(lambda: reason("research", "notebook") == "UsingUnrequestedGPU", "the notebook")
        wait_until(lambda: reason("ml-team", "train-1") == "UsingUnallocatedGPU", "train-1")
        print(f"    (lab computes nothing; flagged after --idle-after={IDLE_AFTER:g}s)")
        wait_until(lambda: reason("research", "lab") == "HoldingIdleGPU", "the idle lab")
        wait_until(lambda: _listed(api) == len(PODS), "the report's status")
        print("    (train-0 and the notebook share a GPU: their shares of its time take 15 s)")
        wait_until(lambda: shares_told(api, {"train-0", "notebook"}), "the shared GPU's shares")
        show(kubectl, detail=True)
        step("who holds the GPU memory, and who gets the compute (COMPUTE: share of GPU time)")
        print("\n$ gpuusage top -A     # also: kubectl gpuusage top -A", flush=True)
        run_top(TopSettings(kubeconfig=cluster.kubeconfig, all_namespaces=True))
        print("\n$ gpuusage top --by namespace   # now; with --window 24h --prometheus URL: hours")
        run_top(TopSettings(kubeconfig=cluster.kubeconfig, by="namespace"))
        print("\n$ gpuusage ps -A      # every GPU process, as nvidia-smi lists them", flush=True)
        run_ps(PsSettings(kubeconfig=cluster.kubeconfig, all_namespaces=True))
        show_reports(step, kubectl, api)
        step("the notebook's kernel leaves the GPU (the scenario changes)")
        write_scenario(scenario, use(notebook=False))
        wait_until(lambda: reason("research", "notebook") == "ProcessesEnded", "the notebook's end")
        wait_until(lambda: _listed(api) == len(PODS) - 1, "the report's status")
        show(kubectl, detail=False)
        show_policies(step, kubectl, api, cluster.kubeconfig)
        left = {
            device: [p for p in listed if p["pid"] != pids["train-1"]]
            for device, listed in use(notebook=False).items()
        }
        write_scenario(scenario, left)  # the evicted pod's process went with it
        if keep:
            _keep(cluster.kubeconfig, workdir)
            return 0
        step("stopping the node and the control plane")
    return 0


def _account(core: client.CoreV1Api, namespace: str) -> Callable[[], Any]:
    return lambda: core.read_namespaced_service_account("default", namespace)


def _phase(core: client.CoreV1Api, namespace: str, name: str, phase: str) -> Callable[[], bool]:
    def reached() -> bool:
        status: Any = core.read_namespaced_pod(name, namespace).status
        return bool(status.phase == phase)

    return reached


def _listed(api: client.ApiClient) -> int:
    raw: Any = client.CustomObjectsApi(api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, DEMO_NODE, _preload_content=False
    )
    return len(json.loads(raw.data).get("status", {}).get("pods", []))


def _keep(kubeconfig: Path, workdir: Path) -> None:
    print(f"\nthe node runs until Enter is pressed; export KUBECONFIG={kubeconfig} ({workdir})")
    with contextlib.suppress(EOFError):  # no terminal: nothing to wait for
        input()
