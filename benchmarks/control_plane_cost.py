"""What a GPU node costs the control plane next to its kubelet's heartbeat, measured by the
apiserver and etcd themselves, side by side on one local control plane.

Three runs of one simulated hour each, one after the other, each measured as the difference of
the apiserver's and etcd's own counters before and after it:

1. **kubelet heartbeat**: a Lease in kube-node-lease renewed every 10 s by an update of the
   whole object (as the kubelet's lease controller does) and the Node's status patched every 5
   minutes with its conditions' heartbeat times (the kubelet's nodeStatusReportFrequency), on
   a Node as large as a GPU node's (capacity and allocatable with nvidia.com/gpu, 25 images).
2. **gpuusage, steady node**: the agent's own parts (NodeReader over a scenario of 8 GPUs, one
   process each, whose memory jitters by a few MiB every cycle, Publisher, LeaseRenewer, default
   settings) offered the 360 cycles of an hour; the operator (in this process, standalone,
   watching the Leases) does what it does with them: status, pod and Event writes included.
3. **gpuusage, busy node**: the same, and every 3 minutes a job ends on one GPU and a new pod's
   job starts there (its pod marked, the ended pod's marks removed, an Event each).
4. **gpuusage, steady node without a Lease**: the steady node's agent with no Lease namespace
   (an install without one, or liveness as before Leases): its report refreshed every
   --heartbeat (60 s), each refresh a new generation and so a status write.

0. **the real kubelet** (where this machine can run a node: root, containerd; see
   `gpuusage local-cluster up --node`): a real kubelet registered with the same control plane,
   steady for a minute, then measured over `--real-kubelet` minutes of real time (10 by
   default) and scaled to the hour. Runs 1-4 then use that control plane too.

The writers' clock is simulated in runs 1-4 (renewTime, observedAt, the agent's refresh), their
writes are real; the operator runs on real time. Only writes are counted (create, update,
patch, delete): reads are served from the apiserver's cache and never reach etcd's history.

    python benchmarks/control_plane_cost.py [--real-kubelet MINUTES]   # 0: runs 1-4 only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests package (fake machines); gpuusage is installed

from gpuusage.api.times import format_micro_time  # noqa: E402
from gpuusage.kube.config import api_client  # noqa: E402
from gpuusage.kube.crds import install_crds  # noqa: E402
from gpuusage.kube.rest import RestClient  # noqa: E402
from gpuusage.retry import poll_until  # noqa: E402
from gpuusage_dev.localcluster.cluster import ClusterState, LocalCluster  # noqa: E402
from gpuusage_dev.localcluster.node import cannot_run_node, running_node  # noqa: E402
from gpuusage_dev.proctree import pod_cgroup, write_process  # noqa: E402
from gpuusage_dev.simulation import Background, create_running_pod, ensure_namespace  # noqa: E402
from gpuusage_nodeagent.gpusource.fake import FakeSource  # noqa: E402
from gpuusage_nodeagent.lease import LeaseRenewer  # noqa: E402
from gpuusage_nodeagent.main import NodeReader  # noqa: E402
from gpuusage_nodeagent.metrics import AgentMetrics  # noqa: E402
from gpuusage_nodeagent.publisher import WRITE_BACKOFF, Publisher  # noqa: E402
from gpuusage_nodeagent.resolver import Resolver  # noqa: E402
from gpuusage_nodeagent.settings import AgentSettings  # noqa: E402
from gpuusage_operator.main import Operator  # noqa: E402
from gpuusage_operator.settings import OperatorSettings  # noqa: E402
from tests.fakenvml import gpu_uuid  # noqa: E402

AGENTS_NS = "gpuusage-system"
DEFAULTS = AgentSettings(node_name="x")
CYCLES = int(3600 / DEFAULTS.interval)
JOB_EVERY = 18  # cycles: a job ends and another starts every 3 minutes on the busy node
T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
WRITE_VERBS = ("create", "update", "patch", "delete")


# -- the control plane's own counters ----------------------------------------------------------
def _scrape(url: str, opener: Callable[[str], bytes]) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in opener(url).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = values.get(name, 0.0) + float(value)
    return values


def counters(api: client.ApiClient, etcd_port: int) -> dict[str, float]:
    """The apiserver's write requests and body bytes by resource, and etcd's revision, bytes
    received from the apiserver and database size."""
    found: dict[str, float] = {}

    def from_apiserver(url: str) -> bytes:
        data: bytes = api.call_api("GET", url).read()
        return data

    def from_etcd(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=10) as response:
            data: bytes = response.read()
            return data

    for name, value in _scrape(f"{api.configuration.host}/metrics", from_apiserver).items():
        for metric, key in (
            ("apiserver_request_body_size_bytes_sum{", "bytes"),
            ("apiserver_request_body_size_bytes_count{", "writes"),
        ):
            if name.startswith(metric):
                labels = dict(
                    part.split("=", 1)
                    for part in name[len(metric) : -1].replace('"', "").split(",")
                )
                if labels.get("verb") in WRITE_VERBS:
                    found[f"{key} {labels['resource']}"] = (
                        found.get(f"{key} {labels['resource']}", 0.0) + value
                    )
    etcd = _scrape(f"http://127.0.0.1:{etcd_port}/metrics", from_etcd)
    found["etcd revision"] = etcd["etcd_debugging_mvcc_current_revision"]
    found["etcd bytes in"] = sum(
        v for k, v in etcd.items() if k.startswith("etcd_network_client_grpc_received_bytes_total")
    )
    found["etcd db bytes"] = etcd["etcd_mvcc_db_total_size_in_bytes"]
    return found


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}


def summary(change: dict[str, float]) -> dict[str, Any]:
    writes = {
        k.split(" ", 1)[1]: int(v) for k, v in change.items() if k.startswith("writes ") and v
    }
    sizes = {k.split(" ", 1)[1]: int(v) for k, v in change.items() if k.startswith("bytes ") and v}
    return {
        "writes": sum(writes.values()),
        "request_bytes": sum(sizes.values()),
        "etcd_revisions": int(change["etcd revision"]),
        "bytes_to_etcd": int(change["etcd bytes in"]),
        "etcd_db_growth_bytes": int(change["etcd db bytes"]),
        "writes_by_resource": writes,
        "request_bytes_by_resource": sizes,
    }


# -- 1. the kubelet's heartbeat ----------------------------------------------------------------
def gpu_node(name: str) -> client.V1Node:
    images = [
        client.V1ContainerImage(
            names=[
                f"nvcr.io/nvidia/workload-{i}@sha256:{i:064x}",
                f"nvcr.io/nvidia/workload-{i}:24.{i % 12 + 1:02d}-py3",
            ],
            size_bytes=(4 + i) * 1_000_000_000,
        )
        for i in range(25)
    ]
    resources = {"cpu": "224", "memory": "2113470100Ki", "nvidia.com/gpu": "8", "pods": "110"}
    return client.V1Node(
        metadata=client.V1ObjectMeta(
            name=name,
            labels={
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": "8",
                "node.kubernetes.io/instance-type": "p5.48xlarge",
            },
        ),
        status=client.V1NodeStatus(
            capacity=resources,
            allocatable=resources,
            images=images,
            node_info=client.V1NodeSystemInfo(
                architecture="amd64",
                boot_id="0c8f5c1e-7f42-4e3a-9a0b-2d51a0a9d7a1",
                container_runtime_version="containerd://1.7.22",
                kernel_version="6.8.0-1015-aws",
                kube_proxy_version="",
                kubelet_version="v1.34.4",
                machine_id="ec2b3c9f0e9b4f0a8d7c6b5a4f3e2d1c",
                operating_system="linux",
                os_image="Ubuntu 22.04.5 LTS",
                system_uuid="ec2b3c9f-0e9b-4f0a-8d7c-6b5a4f3e2d1c",
            ),
            addresses=[
                client.V1NodeAddress(type="InternalIP", address="10.0.12.34"),
                client.V1NodeAddress(type="Hostname", address=name),
            ],
        ),
    )


CONDITIONS = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID"),
    ("Ready", "True", "KubeletReady"),
)


def node_status_patch(now: datetime) -> dict[str, Any]:
    """What the kubelet sends every 5 minutes on a steady node: its conditions with new
    heartbeat times (a strategic merge patch keyed by type)."""
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "status": {
            "conditions": [
                {
                    "type": kind,
                    "status": status,
                    "reason": reason,
                    "message": f"kubelet: {reason}",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": "2026-11-01T00:00:00Z",
                }
                for kind, status, reason in CONDITIONS
            ]
        }
    }


def kubelet_hour(api: client.ApiClient, rest: RestClient, node: str) -> Callable[[], None]:
    """Setup (not measured): the Node and its Lease. Returns the measured hour."""
    core = client.CoreV1Api(api)
    core.create_node(gpu_node(node))
    core.patch_node_status(node, node_status_patch(T0))

    def lease(now: datetime, version: str | None) -> dict[str, Any]:
        """The whole Lease, as the kubelet's lease controller sends it (MicroTime as text: the
        client would drop the microseconds the API requires)."""
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": node,
                "namespace": "kube-node-lease",
                **({"resourceVersion": version} if version else {}),
            },
            "spec": {
                "holderIdentity": node,
                "leaseDurationSeconds": 40,
                "renewTime": format_micro_time(now),
            },
        }

    path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    created = rest.post(path, lease(T0, None))

    def hour() -> None:
        version = created["metadata"]["resourceVersion"]
        for cycle in range(1, CYCLES + 1):
            now = T0 + timedelta(seconds=10 * cycle)
            updated = rest.request("PUT", f"{path}/{node}", lease(now, version))
            version = updated["metadata"]["resourceVersion"]
            if cycle % 30 == 0:
                core.patch_node_status(node, node_status_patch(now))

    return hour


# -- 2, 3. gpuusage ----------------------------------------------------------------------------
class GpuNode:
    """A simulated GPU node: its pods (more than GPUs on the busy node: jobs come and go), a
    /proc tree, and the scenario the agent reads."""

    def __init__(self, api: client.ApiClient, work: Path, node: str, jobs: int) -> None:
        self.core = client.CoreV1Api(api)
        self.node, self.work = node, work
        self.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
        ensure_namespace(self.core, node)
        self.proc = work / f"proc-{node}"
        self.pids: list[int] = []
        for job in range(jobs):
            uid, cid = create_running_pod(self.core, node, f"job-{job}", node, "main")
            pid = 10_000 + job
            write_process(self.proc, pid, pod_cgroup(uid, cid), comm="python", start_ticks=pid)
            self.pids.append(pid)
        self.scenario = work / f"scenario-{node}.yaml"
        self.rng = random.Random(7)
        self.running = list(range(8))  # job index per GPU
        self.next_job = 8

    def write(self) -> None:
        gpus = []
        for index in range(8):
            pid = self.pids[self.running[index]]
            gpus.append(
                {
                    "index": index,
                    "uuid": gpu_uuid(index),
                    "name": "NVIDIA H100 80GB HBM3",
                    "memoryTotalMiB": 81559,
                    "processes": [
                        {
                            "pid": pid,
                            "usedMemoryMiB": 40960 + self.rng.randint(-8, 8),
                            "name": "python",
                            "smUtil": self.rng.randint(30, 99),
                        }
                    ],
                }
            )
        fresh = self.scenario.with_suffix(".new")
        fresh.write_text(yaml.safe_dump({"gpus": gpus}))
        fresh.replace(self.scenario)

    def next_job_starts(self, cycle: int) -> None:
        """One GPU's job ends and the next pod's job starts on it."""
        gpu = (cycle // JOB_EVERY) % 8
        self.running[gpu] = self.next_job % len(self.pids)
        self.next_job += 1


def gpuusage_hour(
    api: client.ApiClient,
    rest: RestClient,
    work: Path,
    node: str,
    busy: bool,
    *,
    lease: bool = True,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Setup (not measured; one cycle published, so the hour starts from a steady state) and
    the measured hour; and a function that waits until the operator caught up."""
    gpu = GpuNode(api, work, node, jobs=24 if busy else 8)
    gpu.write()
    now = [T0]
    reader = NodeReader(node, FakeSource(gpu.scenario), Resolver(gpu.proc), clock=lambda: now[0])
    metrics = AgentMetrics()
    publisher = Publisher(
        rest,
        node,
        heartbeat=timedelta(seconds=DEFAULTS.heartbeat),
        lease_refresh=timedelta(seconds=DEFAULTS.report_refresh) if lease else None,
        threshold_mib=DEFAULTS.memory_threshold_mib,
        metrics=metrics,
    )
    renewer = LeaseRenewer(
        rest,
        AGENTS_NS,
        node,
        metrics=metrics,
        backoff=WRITE_BACKOFF,
        duration=timedelta(seconds=DEFAULTS.lease_duration),
        holder=f"gpuusage-agent/{node}",
    )

    def cycle(seconds: float) -> None:
        now[0] = T0 + timedelta(seconds=seconds)
        publisher.offer(reader.read())
        if lease:
            renewer.renew_if_due(now[0])

    cycle(0)
    custom = client.CustomObjectsApi(api)

    def caught_up() -> None:
        def done() -> bool:
            body = custom.get_cluster_custom_object(
                "gpuusage.io", "v1alpha1", "gpunodeusages", node
            )
            assert isinstance(body, dict)
            status = body.get("status") or {}
            return status.get("observedGeneration") == body["metadata"]["generation"]

        if not poll_until(done, 60, 0.2):
            raise TimeoutError(f"the operator did not catch up with {node}")

    caught_up()
    # Until a write's answer shows the operator judging the node by its Lease, the agent
    # refreshes every heartbeat; the measured hour is the steady state after that.
    start = 0
    while lease and not publisher.judged_by_lease:
        start += 1
        if start > 30:
            raise TimeoutError(f"the operator never judged {node} by its Lease")
        gpu.write()
        cycle(10 * start)
        caught_up()

    def hour() -> None:
        for n in range(start + 1, start + CYCLES + 1):
            if busy and n % JOB_EVERY == 0:
                gpu.next_job_starts(n)
            gpu.write()
            cycle(10 * n)

    return hour, caught_up


def object_size(api: client.ApiClient, name: str) -> dict[str, int]:
    """The report as stored, in compact JSON: what etcd keeps a copy of at every write."""
    body = client.CustomObjectsApi(api).get_cluster_custom_object(
        "gpuusage.io", "v1alpha1", "gpunodeusages", name
    )
    assert isinstance(body, dict)

    def size(value: Any) -> int:
        return len(json.dumps(value, separators=(",", ":")))

    return {"whole": size(body), "spec": size(body["spec"]), "status": size(body["status"])}


def lease_size(api: client.ApiClient, namespace: str, name: str) -> int:
    """A Lease as stored, in compact JSON (managedFields and owner included)."""
    data: bytes = api.call_api(
        "GET",
        f"{api.configuration.host}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
    ).read()
    return len(json.dumps(json.loads(data), separators=(",", ":")))


# -- 0. the real kubelet -----------------------------------------------------------------------
REAL_NODE = "kubelet-real"
WARM_UP = 60.0
"""Seconds the real node runs before it is measured: registration, the device plugin's
resources, the first images and conditions are written in its first seconds."""


def real_kubelet_hour(api: client.ApiClient, etcd: int, minutes: float) -> dict[str, Any]:
    """The real kubelet's writes over `minutes` of real time, scaled to one hour; nothing else
    writes meanwhile (the scheduler and controller-manager run without leader election, the
    operator has no report to reconcile)."""
    time.sleep(WARM_UP)
    before = counters(api, etcd)
    time.sleep(minutes * 60)
    change = delta(before, counters(api, etcd))
    scale = 60.0 / minutes
    result = summary({k: v * scale for k, v in change.items()})
    result["measured_minutes"] = minutes
    result["lease_object_bytes"] = lease_size(api, "kube-node-lease", REAL_NODE)
    return result


QUIET = (
    "--feature-gates=APIServerIdentity=false,UnknownVersionInteroperabilityProxy=false",
    "--endpoint-reconciler-type=none",
)
"""The apiserver's own background writes switched off (its identity Lease and the `kubernetes`
Endpoints, each every 10 s), so that only the measured writers count: over a simulated hour
they hardly show, over the real kubelet's real minutes they would double its figures."""


@contextlib.contextmanager
def control_plane(work: Path, real_kubelet: float) -> Iterator[tuple[LocalCluster, bool]]:
    """The control plane the runs share: with a real node registered where the machine can run
    one and it was asked for (True), else a control plane alone (False)."""
    why = cannot_run_node() if real_kubelet > 0 else "not asked for (--real-kubelet 0)"
    if why is None:
        with running_node(work / "node-cluster", REAL_NODE, apiserver_args=QUIET) as (cluster, _):
            yield cluster, True
        return
    print(f"no real kubelet: {why}", file=sys.stderr, flush=True)
    cluster = LocalCluster(work / "cluster", apiserver_args=list(QUIET))
    cluster.up()
    try:
        yield cluster, False
    finally:
        cluster.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--real-kubelet",
        type=float,
        default=10.0,
        metavar="MINUTES",
        help="minutes of real time to measure a real kubelet over (0: none)",
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="gpuusage-cost-") as folder,
        control_plane(Path(folder), args.real_kubelet) as (cluster, real),
    ):
        work = Path(folder)
        stop_operator: list[Callable[[], None]] = []
        try:
            api, _ = api_client(cluster.kubeconfig)
            install_crds(api)
            ensure_namespace(client.CoreV1Api(api), AGENTS_NS)
            rest, _ = RestClient.from_kubeconfig(cluster.kubeconfig)
            state = ClusterState.load(cluster.state_path)
            assert state is not None
            etcd = state.etcd_client_port
            ready = threading.Event()
            operator = Operator(
                OperatorSettings(
                    kubeconfig=cluster.kubeconfig,
                    standalone=True,
                    lease_namespace=AGENTS_NS,
                    resync=10,
                )
            )
            running = Background(lambda flag: operator.run(flag, ready))
            stop_operator.append(running.halt)
            if not ready.wait(60):
                raise TimeoutError("the operator did not start")
            results: dict[str, Any] = {}
            if real:
                label = "real kubelet"
                results[label] = real_kubelet_hour(api, etcd, args.real_kubelet)
                print(f"{label}: {json.dumps(results[label])}", file=sys.stderr, flush=True)
            for label, prepare in (
                (
                    "kubelet heartbeat",
                    lambda: (kubelet_hour(api, rest, "kubelet-node"), lambda: None),
                ),
                ("gpuusage, steady node", lambda: gpuusage_hour(api, rest, work, "steady", False)),
                ("gpuusage, busy node", lambda: gpuusage_hour(api, rest, work, "busy", True)),
                (
                    "gpuusage, steady node without a Lease",
                    lambda: gpuusage_hour(api, rest, work, "unleased", False, lease=False),
                ),
            ):
                hour, settle = prepare()
                before = counters(api, etcd)
                hour()
                settle()
                results[label] = summary(delta(before, counters(api, etcd)))
                if label == "gpuusage, steady node without a Lease":
                    results[label]["report_object_bytes"] = object_size(api, "unleased")
                elif label.startswith("gpuusage"):
                    node = label.split()[-2]
                    results[label]["report_object_bytes"] = object_size(api, node)
                    results[label]["lease_object_bytes"] = lease_size(api, AGENTS_NS, node)
                else:
                    results[label]["lease_object_bytes"] = lease_size(
                        api, "kube-node-lease", "kubelet-node"
                    )
                print(f"{label}: {json.dumps(results[label])}", file=sys.stderr, flush=True)
            print(json.dumps({"per_node_hour": results}, indent=2))
        finally:
            for halt in stop_operator:
                halt()


if __name__ == "__main__":
    main()
