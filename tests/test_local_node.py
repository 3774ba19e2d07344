"""The real node: a kubelet, containerd, runc, a CNI bridge, the scheduler, the controllers and
our device plugin, registered with the local control plane, running real pods; and stopped
without leaving anything behind. Skipped, with the reason, where the machine cannot run a node
(not root, no containerd, runc or busybox-static).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api.models import DeviceReplicas, Gpu, GpuNodeUsageSpec
from gpuusage.api.resources import SHARED_GPU_RESOURCE
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.localcluster.containerd import (
    CONTAINER_FDS,
    TTRPC_SOCKET,
    Containerd,
    NodeUnavailable,
    base_spec,
    mounts_below,
    socket_too_long,
)
from gpuusage_dev.localcluster.node import (
    BRIDGE,
    CGROUP_ROOT,
    DEFAULT_SCENARIO,
    HOST_PATHS,
    NODE_COMPONENTS,
    Node,
    another_kubelet,
    cannot_run_node,
    cgroup_hierarchies,
    running_node,
    sockets_too_long,
)
from gpuusage_dev.localcluster.workloads import sleeper_deployment
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.cgroup import parse_cgroup_file
from gpuusage_nodeagent.podresources.kubelet import allocations, list_allocatable, list_pods
from gpuusage_nodeagent.podresources.wire import allocatable_response, list_response
from gpuusage_operator.index.dra import NO_DRA
from gpuusage_operator.index.pods import snapshot_of
from gpuusage_operator.judge.allocation import KubeletView, device_facts, judge
from gpuusage_operator.judge.requests import DEFAULT_RULES
from gpuusage_operator.judge.status import handed_share
from tests.conftest import CHILD_ENV, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

NAME = "gpu-node-a"
GPUS = [g["uuid"] for g in DEFAULT_SCENARIO["gpus"]]
SLICED = GPUS[3]
"""Advertised as 4 time-slicing replicas under nvidia.com/gpu.shared; the others whole."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Node]]:
    why = cannot_run_node()
    if why is not None:
        pytest.skip(f"this machine cannot run a node: {why}")
    directory = tmp_path_factory.mktemp("node-cluster")
    before = {str(p) for p in HOST_PATHS if p.exists()}
    with running_node(directory, NAME, time_slicing={SLICED: 4}) as running:
        yield running
    # Nothing left: processes, mounts, cgroups, the bridge, folders outside its own.
    ours = str(directory)
    left = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and ours.encode() in _cmdline(p) and _alive(p)
    ]
    assert left == [], f"processes left: {left}"
    assert mounts_below(directory) == []
    assert not [h for h in cgroup_hierarchies() if (h / CGROUP_ROOT).exists()]
    link = subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True, check=False)
    assert link.returncode != 0, "the bridge is gone"
    assert {str(p) for p in HOST_PATHS if p.exists()} == before


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _alive(proc: Path) -> bool:
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_a_deployment_pod_runs_with_a_device_the_kubelet_hands_out(
    node: tuple[LocalCluster, Node],
) -> None:
    """The scheduler places the pod, the ReplicaSet controller makes it, the kubelet runs it
    with containerd and runc, the device plugin gives it a GPU: PodResources (read by the
    agent's own client) names that device, the container's process has a real cgroup path
    the agent's parser attributes to the pod, below the kubelet's cgroup root."""
    cluster, running = node
    api, _ = api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    ensure_namespace(core, "ml")
    wait_for(lambda: core.read_namespaced_service_account("default", "ml"), what="default SA")
    deployment: Any = sleeper_deployment("train", "ml", 1)  # the client sends a dict as it is
    client.AppsV1Api(api).create_namespaced_deployment("ml", deployment)

    pod = wait_for(
        lambda: _running_pod(core, "ml", "train"), timeout=90, what="the Deployment's pod running"
    )
    assert pod.spec.node_name == NAME
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    socket = running.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    listed = {p.name: p for p in list_response(list_pods(socket, 5))}
    devices = listed[pod.metadata.name].containers[0].devices
    assert [d.resource_name for d in devices] == ["nvidia.com/gpu"]
    assert devices[0].device_ids[0] in GPUS
    found = [
        parse_cgroup_file((p / "cgroup").read_text())
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and cid.encode() in _read(p / "cgroup")
    ]
    assert found, "the container's processes are on the host"
    assert {(f.container_id, f.pod_uid) for f in found} == {(cid, pod.metadata.uid)}


def test_a_time_sliced_gpu_is_handed_out_as_replicas_and_a_pod_is_handed_its_part(
    node: tuple[LocalCluster, Node],
) -> None:
    """The device plugin advertises one GPU as 4 time-slicing replicas, as NVIDIA's does with
    `renameByDefault`: the real kubelet's GetAllocatableResources (read by the agent's own
    client) lists the 4, and List gives a pod that asks for one a `<UUID>::<n>` ID; the
    container sees the GPU itself. The agent's report section says the GPU has 4 replicas and
    the pod holds 1, and the operator's judge hands the pod a quarter of that GPU."""
    cluster, running = node
    api, _ = api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    ensure_namespace(core, "sliced")
    wait_for(lambda: core.read_namespaced_service_account("default", "sliced"), what="SA")
    deployment: Any = sleeper_deployment("share", "sliced", 0)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {SHARED_GPU_RESOURCE: "1"}}
    client.AppsV1Api(api).create_namespaced_deployment("sliced", deployment)
    pod = wait_for(lambda: _running_pod(core, "sliced", "share"), timeout=90, what="running")
    socket = running.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    advertised = allocatable_response(list_allocatable(socket, 5))
    shared = [d for d in advertised if d.resource_name == SHARED_GPU_RESOURCE]
    assert sorted(i for d in shared for i in d.device_ids) == [f"{SLICED}::{n}" for n in range(4)]
    listed = list_response(list_pods(socket, 5))
    given = {p.name: p for p in listed}[pod.metadata.name].containers[0].devices
    assert [d.resource_name for d in given] == [SHARED_GPU_RESOURCE]
    assert [i.split("::")[0] for i in given[0].device_ids] == [SLICED]
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    environ = Path(f"/proc/{running.host_pid(cid)}/environ").read_bytes().split(b"\0")
    assert f"NVIDIA_VISIBLE_DEVICES={SLICED}".encode() in environ
    section = allocations(listed, advertised=advertised)
    assert section.replicated == [DeviceReplicas(device=SLICED, replicas=4)]
    entry = next(p for p in section.pods if p.name == pod.metadata.name)
    assert entry.replicas == [DeviceReplicas(device=SLICED, replicas=1)]
    spec = GpuNodeUsageSpec(
        node_name=NAME,
        observed_at=datetime.now(UTC),
        gpus=[Gpu(index=i, uuid=u) for i, u in enumerate(GPUS)],
        kubelet=section,
    )
    raw: Any = core.read_namespaced_pod(pod.metadata.name, "sliced", _preload_content=False)
    snapshot = snapshot_of(json.loads(raw.data))
    assert snapshot is not None
    view, facts = KubeletView.of(spec), device_facts(spec)
    judged = judge(snapshot.claimed, [SLICED], NO_DRA, DEFAULT_RULES, facts, kubelet=view)
    assert judged.finding is None
    assert handed_share(judged.allocation.devices, SLICED, snapshot.fraction) == 0.25


def test_the_nodes_parts_crash_and_come_back_and_the_containers_outlive_them(
    node: tuple[LocalCluster, Node],
) -> None:
    """`local-cluster restart --component` on each of the node's parts: it is killed (SIGKILL)
    and started again with a new pid while the other parts keep theirs; the pod's container
    is the same process throughout (never restarted), and the node is Ready with its devices
    after each. The fixture then proves `down` leaves nothing behind."""
    cluster, running = node
    api, _ = api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    ensure_namespace(core, "crash")
    wait_for(lambda: core.read_namespaced_service_account("default", "crash"), what="SA")
    deployment: Any = sleeper_deployment("steady", "crash", 1)
    client.AppsV1Api(api).create_namespaced_deployment("crash", deployment)
    pod = wait_for(lambda: _running_pod(core, "crash", "steady"), timeout=90, what="running")
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    process = running.host_pid(cid)
    for component in NODE_COMPONENTS:
        before = running.pids()
        done = subprocess.run(
            [
                *(sys.executable, "-m", "gpuusage.cli", "local-cluster", "restart"),
                *("--dir", str(cluster.directory), "--component", component),
            ],
            env=CHILD_ENV,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"crashed and restarted the node's {component}; node {NAME} Ready" in done.stdout
        after = running.pids()
        assert after.keys() == before.keys()
        assert after[component] != before[component]
        assert {k: v for k, v in after.items() if k != component} == {
            k: v for k, v in before.items() if k != component
        }
        assert running.host_pid(cid) == process, f"the container outlived the {component}"
        now: Any = core.read_namespaced_pod(pod.metadata.name, "crash")
        assert now.metadata.uid == pod.metadata.uid
        assert now.status.container_statuses[0].restart_count == 0


def _running_pod(core: client.CoreV1Api, namespace: str, app: str) -> client.V1Pod | None:
    pods = core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
    ready = [p for p in pods if p.status and p.status.phase == "Running"]
    return ready[0] if ready else None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_the_kubelet_is_confined_as_a_node_is(node: tuple[LocalCluster, Node]) -> None:
    """Its own credentials (system:node:NAME) may read its Node but not label another one:
    the Node authorizer and NodeRestriction are on, as on a real cluster."""
    cluster, running = node
    kubectl = [
        str(cluster.binaries.kubectl),
        "--kubeconfig",
        str(running.directory / "kubelet.kubeconfig"),
    ]
    admin = client.CoreV1Api(api_client(cluster.kubeconfig)[0])
    admin.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="other-node")))
    own = subprocess.run(
        [*kubectl, "get", "node", NAME, "-o", "json"], check=False, capture_output=True, text=True
    )
    assert own.returncode == 0
    allocatable = json.loads(own.stdout)["status"]["allocatable"]
    assert allocatable["nvidia.com/gpu"] == str(len(GPUS) - 1)
    assert allocatable[SHARED_GPU_RESOURCE] == "4", "the time-sliced GPU's replicas"
    other = subprocess.run(
        [*kubectl, "label", "node", "other-node", "stolen=true"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert other.returncode != 0
    assert "forbidden" in other.stderr.lower()


def test_a_second_node_is_refused_while_a_kubelet_serves_the_machine(tmp_path: Path) -> None:
    """The device-plugin socket is fixed per machine: a live one refuses a second node with
    the reason; a stopped kubelet's leftover socket file does not."""
    path = tmp_path / "kubelet.sock"
    assert another_kubelet(path) is None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    try:
        why = another_kubelet(path)
        assert why is not None
        assert f"another kubelet serves {path}" in why
    finally:
        server.close()
    assert path.exists()
    assert another_kubelet(path) is None, "nobody answers: a stopped kubelet's file"


def test_a_folder_too_deep_for_the_nodes_sockets_is_refused_with_the_reason() -> None:
    """A node's deepest socket past containerd's limit is refused before anything starts,
    naming the path and its length, not left to a daemon's failure in a log."""
    fits = Path("/tmp") / ("d" * 64)  # the kubelet's socket: 104 characters
    assert sockets_too_long(fits) is None
    deep = Path("/tmp") / ("d" * 65)
    why = sockets_too_long(deep)
    assert why is not None
    assert f"{deep}/kubelet/pod-resources/kubelet.sock is 105 characters" in why
    assert "pick a shorter --dir" in why


def test_a_dra_node_counts_the_drivers_sockets_too() -> None:
    """With DRA the deepest socket is the driver's registration in the kubelet's root dir: a
    folder that fits a device-plugin node is refused for a DRA node, naming that socket."""
    fits = Path("/tmp") / ("d" * 50)  # the registration socket: 104 characters
    assert sockets_too_long(fits, dra=True) is None
    deep = Path("/tmp") / ("d" * 51)
    assert sockets_too_long(deep) is None
    why = sockets_too_long(deep, dra=True)
    assert why is not None
    assert f"{deep}/kubelet/plugins_registry/gpu.nvidia.com-reg.sock is 105 characters" in why


def test_containerd_refuses_a_folder_too_deep_for_its_sockets() -> None:
    """containerd alone (the image tests run it without a node) is refused before it starts,
    not after its 30 s timeout with the reason in its log."""
    deep = Path("/tmp") / ("d" * 67) / "containerd"
    assert socket_too_long(deep / TTRPC_SOCKET) == (
        f"{deep}/containerd.sock.ttrpc is 105 characters, more than 104"
    )
    assert socket_too_long(Path("/tmp") / ("d" * 66) / "containerd" / TTRPC_SOCKET) is None
    with pytest.raises(NodeUnavailable, match="too deep for its sockets"):
        Containerd(deep).start()


def test_containers_start_with_containerd_2s_fd_limits() -> None:
    """The base runtime spec: the default one with containerd 2's RLIMIT_NOFILE in place of
    the default's, its other limits and fields kept; the hard limit no higher than this
    machine allows."""
    default: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "args": ["sh"],
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 1024},
                {"type": "RLIMIT_NPROC", "soft": 100, "hard": 100},
            ],
        },
        "linux": {"namespaces": []},
    }
    spec = base_spec(default, 1 << 20)
    assert spec["process"]["rlimits"] == [
        {"type": "RLIMIT_NPROC", "soft": 100, "hard": 100},
        {"type": "RLIMIT_NOFILE", "soft": CONTAINER_FDS[0], "hard": CONTAINER_FDS[1]},
    ]
    assert (spec["linux"], spec["process"]["args"]) == (default["linux"], ["sh"])
    assert default["process"]["rlimits"][0]["soft"] == 1024, "the default left as it was"
    low = base_spec(default, 20_000)["process"]["rlimits"][-1]
    assert (low["soft"], low["hard"]) == (1024, 20_000)
    tiny = base_spec(default, 512)["process"]["rlimits"][-1]
    assert (tiny["soft"], tiny["hard"]) == (512, 512)
