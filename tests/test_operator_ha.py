"""HA on the real apiserver: two operator processes share a ClusterKopfPeering, one is active,
and the standby takes over when the active one is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.announcement import decode
from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Memory, Process, Source
from gpuusage.kube.crds import ensure_peering
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import create_running_pod, ensure_namespace
from gpuusage_operator.ha.peering import live_peers
from tests.conftest import CHILD_ENV, wait_for
from tests.fakenvml import gpu_uuid
from tests.worldview import create_policy, in_namespace

pytestmark = pytest.mark.cluster
LIFETIME = 10


def _spec(node: str, container_id: str | None) -> dict[str, Any]:
    processes = (
        []
        if container_id is None
        else [Process(pid=4242, name="python3", used_memory_mib=4096, container_id=container_id)]
    )
    gpu = Gpu(
        index=0,
        uuid=gpu_uuid(0),
        memory=Memory(total_mib=81920, used_mib=4096),
        processes=processes,
    )
    spec = GpuNodeUsageSpec(
        node_name=node,
        observed_at=datetime.now(UTC),
        source=Source(kind="fake", available=True),
        gpus=[gpu],
    )
    return spec.to_api()


def _replica(
    cluster: LocalCluster, peering: str, priority: int, log: Path, *extra: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuusage.cli",
            "--log-level",
            "info",
            "operator",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--peering",
            peering,
            "--priority",
            str(priority),
            "--peering-lifetime",
            str(LIFETIME),
            "--stale-after",
            "600",
            "--resync",
            "0.5",
            *extra,
        ],
        env=CHILD_ENV,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        text=True,
    )


@dataclass(frozen=True)
class HaSetup:
    """A node with a running pod in a namespace of its own, and a peering for the replicas."""

    core: Any
    """A client.CoreV1Api. Typed Any: its models make every field optional, and the tests read
    them as the apiserver fills them."""
    ns: str
    node: str
    cid: str
    """The pod's container ID."""
    peering: str


@pytest.fixture
def setup(cluster: LocalCluster, api: client.ApiClient) -> HaSetup:
    core = client.CoreV1Api(api)
    ns, node = f"ha-{uuid.uuid4().hex[:6]}", f"gpu-ha-{uuid.uuid4().hex[:6]}"
    ensure_namespace(core, ns)
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
    _uid, cid = create_running_pod(core, ns, "train", node, "trainer")
    peering = f"ha-{uuid.uuid4().hex[:6]}"
    ensure_peering(api, peering)
    return HaSetup(core, ns, node, cid, peering)


def _peers(api: client.ApiClient, peering: str) -> dict[str, int]:
    body = client.CustomObjectsApi(api).get_cluster_custom_object(
        names.PEERING_GROUP, names.PEERING_VERSION, names.PEERING_PLURAL, peering
    )
    assert isinstance(body, dict)
    return live_peers(body.get("status") or {}, datetime.now(UTC))


def _events(setup: HaSetup, api: client.ApiClient) -> dict[str, str]:
    """reason → reportingInstance of the Events on the pod."""
    found = client.EventsV1Api(api).list_namespaced_event(setup.ns).items
    return {str(e.reason): str(e.reporting_instance) for e in found}


def _condition(setup: HaSetup) -> str | None:
    pod = setup.core.read_namespaced_pod("train", setup.ns)
    for cond in pod.status.conditions or []:
        if cond.type == names.POD_CONDITION_GPU_IN_USE:
            return str(cond.status)
    return None


def test_one_replica_active_and_the_standby_takes_over_after_a_crash(
    cluster: LocalCluster, api: client.ApiClient, setup: HaSetup, tmp_path: Path
) -> None:
    custom = client.CustomObjectsApi(api)
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": setup.node},
        "spec": _spec(setup.node, setup.cid),
    }
    custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, body)
    active = _replica(cluster, setup.peering, 200, tmp_path / "active.log")
    standby = _replica(cluster, setup.peering, 100, tmp_path / "standby.log")
    try:
        peers = wait_for(
            lambda: len(p := _peers(api, setup.peering)) == 2 and p,
            what="both replicas in the peering",
        )
        identity = {prio: ident for ident, prio in peers.items()}
        assert identity[200].endswith(f"/{active.pid}")
        assert identity[100].endswith(f"/{standby.pid}")

        wait_for(lambda: _condition(setup) == "True", what="the active replica marks the pod")
        # The Event follows the condition write: wait for it rather than race it.
        wait_for(
            lambda: _events(setup, api) == {"GPUUseStarted": identity[200]},
            what="the start Event, recorded by the active replica",
        )
        standby_log = tmp_path / "standby.log"
        wait_for(  # the standby asked whether it may write, and was told no
            lambda: "this replica is on standby" in standby_log.read_text(), what="a standby"
        )
        assert "this replica is active" not in standby_log.read_text()
        assert set(_events(setup, api).values()) == {identity[200]}, "only the active one wrote"

        active.send_signal(signal.SIGKILL)  # a crash: no goodbye in the peering object
        active.wait(10)
        killed = time.monotonic()
        spec = _spec(setup.node, None)  # the process ended meanwhile
        custom.patch_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL, setup.node, {"spec": spec}
        )
        wait_for(
            lambda: _condition(setup) == "False",
            timeout=LIFETIME + 30,
            what="the standby to take over and end the pod's GPU use",
        )
        failover = time.monotonic() - killed
        assert failover <= LIFETIME + 15, f"failover took {failover:.1f} s"
        ended = {"GPUUseStarted": identity[200], "GPUUseEnded": identity[100]}
        wait_for(
            lambda: _events(setup, api) == ended,
            what="the end Event, recorded by the former standby",
        )
        assert "this replica is active" in (tmp_path / "standby.log").read_text()
        # One Event per transition across the two replicas: none written twice, none counted
        # twice in a series.
        written = client.EventsV1Api(api).list_namespaced_event(setup.ns).items
        assert sorted(str(e.reason) for e in written) == ["GPUUseEnded", "GPUUseStarted"]
        assert all(e.series is None for e in written)
        print(f"failover after SIGKILL of the active replica: {failover:.1f} s")

        standby.send_signal(signal.SIGTERM)  # a clean stop leaves the peering at once
        assert standby.wait(30) == 0
        assert identity[100] not in _peers(api, setup.peering)
    finally:
        for proc in (active, standby):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_two_replicas_act_once_and_a_deadline_survives_the_handover(
    cluster: LocalCluster, api: client.ApiClient, setup: HaSetup, tmp_path: Path
) -> None:
    """A pod uses a GPU it never requested under an enforced Evict. The active replica
    announces it (the annotation and one Pending Event) and is killed before the deadline;
    the standby takes over, reads the deadline from the annotation, and evicts once: one
    Pending, one Acted, each by one replica, one action in the policy's status."""
    core = setup.core
    ns, node = setup.ns, setup.node
    _uid, cid = create_running_pod(core, ns, "sneaky", node, "sneaky", gpus=0)
    custom = client.CustomObjectsApi(api)
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": node},
        "spec": _spec(node, cid),
    }
    custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, body)
    policy = f"evict-{ns}"
    rule = {"finding": "UsingUnrequestedGPU", "after": "1s", "action": "Evict", "mode": "Enforce"}
    create_policy(api, policy, {"namespaceSelector": in_namespace(ns), "rules": [rule]})
    extra = ("--policy-actions", "--policy-notice", "6")
    active = _replica(cluster, setup.peering, 200, tmp_path / "active.log", *extra)
    standby = _replica(cluster, setup.peering, 100, tmp_path / "standby.log", *extra)

    def policy_events() -> list[tuple[str, str]]:
        found = client.EventsV1Api(api).list_namespaced_event(ns).items
        return sorted(
            (str(e.reason), str(e.reporting_instance))
            for e in found
            if str(e.reason).startswith("GPUPolicy")
        )

    try:
        peers = wait_for(
            lambda: len(p := _peers(api, setup.peering)) == 2 and p,
            what="both replicas in the peering",
        )
        identity = {prio: ident for ident, prio in peers.items()}

        def status() -> dict[str, Any]:
            found: Any = custom.get_cluster_custom_object(
                names.GROUP, names.VERSION, names.POLICY_PLURAL, policy
            )
            return dict(found.get("status") or {})

        def announcement() -> str | None:
            found: Any = core.read_namespaced_pod("sneaky", ns).metadata.annotations or {}
            value = found.get(names.ANNOTATION_POLICY_ACTION)
            return None if value is None else str(value)

        announced = wait_for(announcement, what="the announcement")
        # the Event follows the annotation, and the status follows both at the end of the
        # reconcile: wait for them rather than race them
        wait_for(
            lambda: policy_events() == [("GPUPolicyPending", identity[200])],
            what="the Pending Event, by the active replica",
        )
        wait_for(
            lambda: [d["outcome"] for d in status().get("decisions") or []] == ["Pending"],
            what="the Pending decision in the policy's status",
        )
        active.send_signal(signal.SIGKILL)  # before the deadline (--policy-notice 6 s)
        active.wait(10)
        assert datetime.now(UTC) < decode_due(announced), "killed before the deadline"
        wait_for(
            lambda: core.read_namespaced_pod("sneaky", ns).metadata.deletion_timestamp,
            timeout=LIFETIME + 40,
            what="the standby evicting the pod",
        )
        wait_for(
            lambda: (
                policy_events()
                == [("GPUPolicyActed", identity[100]), ("GPUPolicyPending", identity[200])]
            ),
            what="one Acted Event, by the former standby",
        )
        assert announcement() != announced  # now marked as done

        wait_for(lambda: status().get("actionsTaken") == 1, what="one action in the status")
        outcomes = sorted(d["outcome"] for d in status()["decisions"])
        assert outcomes == ["Done", "Pending"]
    finally:
        for proc in (active, standby):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        custom.delete_cluster_custom_object(names.GROUP, names.VERSION, names.POLICY_PLURAL, policy)


def decode_due(annotation: str) -> datetime:
    found = decode(annotation)
    assert found is not None
    return found.due
