"""HA on the real apiserver: two operator processes elect their leader through a Lease.

Short durations (lease 6 s, renew deadline 4 s, retry 1 s) keep the tests quick. Proven: only
the leader writes; a leader killed is replaced within lease duration + retry period; a leader
paused (SIGSTOP) past its renew deadline and resumed acts no more; an apiserver that goes
away for longer than the lease and comes back hands nothing out twice; under an enforced
policy limited to one action an hour, one action is taken across each handover, once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Memory, Process, Source
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import create_running_pod, ensure_namespace
from gpuusage_operator.ha.election import LeaseRecord
from gpuusage_operator.ha.leader import LeaseLock
from gpuusage_operator.judge.restarts import SETTLE
from tests.conftest import CHILD_ENV, wait_for
from tests.fakenvml import gpu_uuid
from tests.worldview import create_policy, in_namespace

pytestmark = pytest.mark.cluster
LEASE, RENEW, RETRY = 6, 4, 1
TAKEOVER = LEASE + RETRY
"""The longest a standby may take to take over from a leader that stopped renewing: it saw
the last renewal within a retry period of it, and waits a lease from then."""
PEERING_FLAGS = ("--peering", "--priority", "--peering-lifetime")
LATENCY = 1.0
"""Room for the requests' own time on a loaded 2-core machine."""


def _spec(node: str, container_ids: list[str]) -> dict[str, Any]:
    processes = [
        Process(pid=4242 + n, name="python3", used_memory_mib=4096, container_id=cid)
        for n, cid in enumerate(container_ids)
    ]
    gpu = Gpu(
        index=0,
        uuid=gpu_uuid(0),
        memory=Memory(total_mib=81920, used_mib=4096 * len(processes)),
        processes=processes,
    )
    spec = GpuNodeUsageSpec(
        node_name=node,
        observed_at=datetime.now(UTC),
        source=Source(kind="fake", available=True),
        gpus=[gpu],
    )
    return spec.to_api()


@dataclass
class Replica:
    process: subprocess.Popen[str]
    log: Path

    @property
    def identity_suffix(self) -> str:
        return f"/{self.process.pid}"

    def said(self, text: str) -> int:
        return self.log.read_text().count(text)


@dataclass
class HaSetup:
    """A node with pods in a namespace of its own, the Lease's place, and the replicas."""

    api: client.ApiClient
    core: Any
    """A client.CoreV1Api. Typed Any: its models make every field optional, and the tests read
    them as the apiserver fills them."""
    cluster: LocalCluster
    ns: str
    node: str
    tmp: Path
    replicas: list[Replica]

    def start(self, name: str, *extra: str) -> Replica:
        log = self.tmp / f"{name}.log"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuusage.cli",
                "--log-level",
                "info",
                "operator",
                "--kubeconfig",
                str(self.cluster.kubeconfig),
                "--leader-elect-resource-namespace",
                self.ns,
                "--leader-elect-lease-duration",
                str(LEASE),
                "--leader-elect-renew-deadline",
                str(RENEW),
                "--leader-elect-retry-period",
                str(RETRY),
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
        replica = Replica(process, log)
        self.replicas.append(replica)
        return replica

    def lease(self) -> Any:
        return client.CoordinationV1Api(self.api).read_namespaced_lease(names.LEADER_LEASE, self.ns)

    def holder(self) -> str:
        return str(self.lease().spec.holder_identity or "")

    def leader(self) -> tuple[Replica, Replica]:
        """(the leader, the other), once one holds the Lease."""
        holder = wait_for(self.holder, what="a replica to take the Lease")
        first, second = self.replicas
        return (first, second) if holder.endswith(first.identity_suffix) else (second, first)

    def events(self) -> list[tuple[str, str]]:
        """(reason, reportingInstance) of the Events in the namespace, sorted."""
        found = client.EventsV1Api(self.api).list_namespaced_event(self.ns).items
        return sorted((str(e.reason), str(e.reporting_instance)) for e in found)


@pytest.fixture
def setup(cluster: LocalCluster, api: client.ApiClient, tmp_path: Path) -> Iterator[HaSetup]:
    core = client.CoreV1Api(api)
    ns, node = f"ha-{uuid.uuid4().hex[:6]}", f"gpu-ha-{uuid.uuid4().hex[:6]}"
    ensure_namespace(core, ns)
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
    ha = HaSetup(api, core, cluster, ns, node, tmp_path, [])
    try:
        yield ha
    finally:
        for replica in ha.replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGCONT)
                replica.process.kill()
                replica.process.wait(10)


def _report(setup: HaSetup, container_ids: list[str]) -> None:
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": setup.node},
        "spec": _spec(setup.node, container_ids),
    }
    client.CustomObjectsApi(setup.api).create_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, body
    )


def _condition(setup: HaSetup, pod: str) -> str | None:
    found = setup.core.read_namespaced_pod(pod, setup.ns)
    for cond in found.status.conditions or []:
        if cond.type == names.POD_CONDITION_GPU_IN_USE:
            return str(cond.status)
    return None


def test_one_replica_acts_and_the_other_takes_over_within_the_lease_after_a_kill(
    setup: HaSetup,
) -> None:
    """(a) only the leader writes; (d) SIGKILL of the leader: the other takes the Lease within
    lease duration + retry period and acts; a clean stop hands the Lease over within a retry
    period."""
    _uid, cid = create_running_pod(setup.core, setup.ns, "train", setup.node, "trainer")
    _report(setup, [cid])
    # the flags of the peering, as an install from before sets them: accepted, ignored, said
    setup.start("first", "--peering", "gpuusage", "--priority", "200", "--peering-lifetime", "10")
    setup.start("second")
    leader, standby = setup.leader()
    first = setup.replicas[0]
    warnings = [f"{flag} is ignored since leadership is a Lease" for flag in PEERING_FLAGS]
    wait_for(lambda: all(first.said(w) == 1 for w in warnings), what="a warning for each such flag")
    me = setup.holder()
    wait_for(lambda: _condition(setup, "train") == "True", what="the leader marks the pod")
    wait_for(lambda: setup.events() == [("GPUUseStarted", me)], what="its start Event")
    wait_for(lambda: standby.said("this replica is on standby"), what="the standby to say so")
    assert not standby.said("this replica is active")
    assert leader.said("this replica is active") == 1

    leader.process.send_signal(signal.SIGKILL)  # a crash: the Lease is not released
    leader.process.wait(10)
    killed = datetime.now(UTC)
    killed_steady = time.monotonic()
    custom = client.CustomObjectsApi(setup.api)
    custom.patch_cluster_custom_object(  # the process ended meanwhile
        names.GROUP, names.VERSION, names.PLURAL, setup.node, {"spec": _spec(setup.node, [])}
    )
    wait_for(
        lambda: setup.holder().endswith(standby.identity_suffix),
        timeout=TAKEOVER + 20,
        what="the standby to take the Lease",
    )
    lease = setup.lease()
    takeover = (lease.spec.acquire_time - killed).total_seconds()
    assert lease.spec.lease_transitions == 1
    wait_for(lambda: _condition(setup, "train") == "False", what="the new leader to act")
    acted = time.monotonic() - killed_steady
    assert acted <= TAKEOVER + LATENCY + SETTLE.total_seconds(), "marks settle first (restarts)"
    new = setup.holder()
    wait_for(
        lambda: setup.events() == [("GPUUseEnded", new), ("GPUUseStarted", me)],
        what="the end Event, by the new leader",
    )
    written = client.EventsV1Api(setup.api).list_namespaced_event(setup.ns).items
    assert all(e.series is None for e in written), "no Event written twice"
    print(f"SIGKILL: Lease taken after {takeover:.1f} s, the pod marked after {acted:.1f} s")
    assert takeover <= TAKEOVER + LATENCY, f"took the Lease {takeover:.1f} s after the kill"

    # A rolling update: a new replica stands by, the leader stops cleanly and releases the
    # Lease, and the new one takes it within a retry period, not a lease.
    third = setup.start("third")
    wait_for(lambda: third.said("this replica is on standby"), what="the new replica to stand by")
    standby.process.send_signal(signal.SIGTERM)
    assert standby.process.wait(30) == 0
    stopped = datetime.now(UTC)
    assert standby.said(f"released Lease {setup.ns}/{names.LEADER_LEASE}")
    wait_for(lambda: setup.holder().endswith(third.identity_suffix), what="the new replica to lead")
    handover = (setup.lease().spec.acquire_time - stopped).total_seconds()
    print(f"clean stop: the Lease taken {handover:.1f} s after the leader exited")
    assert handover <= RETRY + LATENCY, f"the Lease taken {handover:.1f} s after the stop"
    assert setup.lease().spec.lease_transitions == 2, "the release counts none, the take one"


@dataclass(frozen=True)
class Enforced:
    """Two pods using a GPU they never requested, under a policy that evicts such pods and
    may act once an hour: every handover must leave exactly one eviction."""

    policy: str
    pods: tuple[str, str] = ("sneaky-a", "sneaky-b")


def _enforced(setup: HaSetup) -> Enforced:
    enforced = Enforced(f"evict-{setup.ns}")
    cids = [
        create_running_pod(setup.core, setup.ns, pod, setup.node, pod, gpus=0)[1]
        for pod in enforced.pods
    ]
    _report(setup, cids)
    rule = {"finding": "UsingUnrequestedGPU", "after": "1s", "action": "Evict", "mode": "Enforce"}
    spec = {"namespaceSelector": in_namespace(setup.ns), "rules": [rule], "maxActionsPerHour": 1}
    create_policy(setup.api, enforced.policy, spec)
    return enforced


def _evicted(setup: HaSetup, enforced: Enforced) -> list[str]:
    return [
        pod
        for pod in enforced.pods
        if setup.core.read_namespaced_pod(pod, setup.ns).metadata.deletion_timestamp
    ]


def _policy_events(setup: HaSetup) -> list[tuple[str, str]]:
    """(reason, reportingInstance) of the policies' Events, sorted."""
    return [(reason, by) for reason, by in setup.events() if reason.startswith("GPUPolicy")]


def _policy_reasons(setup: HaSetup) -> Counter[str]:
    return Counter(reason for reason, _ in _policy_events(setup))


def _actions_taken(setup: HaSetup, enforced: Enforced) -> int:
    found: Any = client.CustomObjectsApi(setup.api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, enforced.policy
    )
    return int((found.get("status") or {}).get("actionsTaken") or 0)


def _announced(setup: HaSetup, enforced: Enforced) -> bool:
    return all(
        names.ANNOTATION_POLICY_ACTION
        in (setup.core.read_namespaced_pod(pod, setup.ns).metadata.annotations or {})
        for pod in enforced.pods
    )


def _one_action_once(setup: HaSetup, enforced: Enforced, by: str) -> None:
    """One eviction, its Acted Event by `by`, the other pod held back by the rate limit."""
    wait_for(lambda: len(_evicted(setup, enforced)) == 1, timeout=30, what="one eviction")
    wait_for(
        lambda: ("GPUPolicyActed", by) in _policy_events(setup),
        what="the Acted Event, by the leader",
    )
    wait_for(
        lambda: _policy_reasons(setup)["GPUPolicyRateLimited"] >= 1,
        what="the other pod held back by the policy's limit",
    )
    wait_for(lambda: _actions_taken(setup, enforced) == 1, what="one action in the status")


def _stays_one(setup: HaSetup, enforced: Enforced) -> None:
    """For a renew deadline more, nothing changes: one eviction, one Acted Event (written
    once, no series), one action in the policy's status."""
    deadline = time.monotonic() + RENEW
    while time.monotonic() < deadline:
        assert len(_evicted(setup, enforced)) == 1
        assert _policy_reasons(setup)["GPUPolicyActed"] == 1, _policy_events(setup)
        time.sleep(0.2)
    assert _actions_taken(setup, enforced) == 1
    written = client.EventsV1Api(setup.api).list_namespaced_event(setup.ns).items
    acted = [e for e in written if e.reason == "GPUPolicyActed"]
    assert len(acted) == 1
    assert acted[0].series is None, "the Acted Event was not written twice"


def _both_announced(setup: HaSetup) -> tuple[Enforced, Replica, Replica]:
    """Two replicas with policy actions, the enforced policy (its name), both pods announced
    and their Pending Events written by the leader: (policy, leader, standby)."""
    enforced = _enforced(setup)
    extra = ("--policy-actions", "--policy-notice", "5")
    setup.start("first", *extra)
    setup.start("second", *extra)
    leader, standby = setup.leader()
    me = setup.holder()
    wait_for(lambda: _announced(setup, enforced), what="both pods announced")
    wait_for(
        lambda: _policy_events(setup) == [("GPUPolicyPending", me)] * 2,
        what="two Pending Events, by the leader",
    )
    return enforced, leader, standby


def test_a_leader_paused_past_its_renew_deadline_acts_no_more_when_it_wakes(
    setup: HaSetup,
) -> None:
    """(b) Both pods are announced; the leader is paused (SIGSTOP) before the deadline with
    its deadlines queued. The other takes over within lease duration + retry period and
    evicts one pod (the limit holds back the other). Resumed (SIGCONT), the old leader finds
    its renew deadline past: it evicts nothing, writes no Event, takes no action."""
    enforced, leader, standby = _both_announced(setup)
    assert _evicted(setup, enforced) == [], "paused before the deadline"
    leader.process.send_signal(signal.SIGSTOP)
    paused = time.monotonic()
    wait_for(
        lambda: setup.holder().endswith(standby.identity_suffix),
        timeout=TAKEOVER + 20,
        what="the other replica to take the Lease",
    )
    took = time.monotonic() - paused
    new = setup.holder()
    wait_for(lambda: _evicted(setup, enforced), what="the new leader to evict")
    evicted = time.monotonic() - paused  # the deadline passed during the pause: at once
    _one_action_once(setup, enforced, new)
    print(f"SIGSTOP: the Lease taken {took:.1f} s after the pause, a pod evicted {evicted:.1f} s")
    assert took <= TAKEOVER + LATENCY

    before = leader.said("this replica is on standby")
    leader.process.send_signal(signal.SIGCONT)  # its deadlines come due at once
    _stays_one(setup, enforced)
    wait_for(
        lambda: leader.said("this replica is on standby") > before,
        what="the woken replica to say it stands by",
    )
    assert setup.holder() == new, "the woken replica did not take the Lease back"


def test_an_apiserver_away_longer_than_the_lease_hands_out_nothing_twice(
    setup: HaSetup,
) -> None:
    """(c) The apiserver stops while both pods' deadline passes, for longer than the lease:
    the leader stops at its renew deadline; once the apiserver is back, one replica (either)
    leads and evicts one pod, once."""
    enforced, leader, _standby = _both_announced(setup)
    before = leader.said("this replica is on standby")
    setup.cluster.stop_apiserver()
    try:
        wait_for(
            lambda: leader.said("this replica is on standby") > before,
            timeout=RENEW + 10,
            what="the leader to stop at its renew deadline",
        )
        stopped = time.monotonic()
        wait_for(lambda: time.monotonic() - stopped > LEASE, what="a whole lease to pass")
    finally:
        setup.cluster.start_apiserver()
    wait_for(setup.holder, what="a leader after the restart")
    _one_action_once(setup, enforced, setup.holder())
    _stays_one(setup, enforced)
    print(f"apiserver away {LEASE + RENEW}+ s: the Lease went to {setup.holder()}")


def test_the_lease_lock_round_trips_times_on_a_whole_second(api: client.ApiClient) -> None:
    """A MicroTime must carry its six digits: a time on a whole second (1 renewal in 10⁶) is
    written with its `.000000` and read back equal, never refused by the apiserver."""
    lock = LeaseLock(api, "default", f"whole-second-{uuid.uuid4().hex[:6]}")
    on_the_second = datetime(2026, 11, 29, 3, 0, 0, tzinfo=UTC)
    wanted = LeaseRecord("me/1", 15.0, on_the_second, on_the_second, 0, "")
    written = lock.write(wanted)
    assert (written.acquired, written.renewed) == (on_the_second, on_the_second)
    assert lock.get() == written
    renewed = lock.write(
        LeaseRecord(
            "me/1", 15.0, on_the_second, on_the_second.replace(second=15), 0, written.version
        )
    )
    assert renewed.renewed == on_the_second.replace(second=15)
    client.CoordinationV1Api(api).delete_namespaced_lease(lock.name, lock.namespace)
