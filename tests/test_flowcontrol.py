"""The agents cannot starve the control plane: their requests run in an API Priority and
Fairness level of their own (manifests/base/flowcontrol, the chart's flowcontrol.yaml), proven
on the real apiserver under real ServiceAccount tokens: the agents' requests are classified
there and nobody else's are, and a flood from one agent's token is queued and refused within
that level while another ServiceAccount's requests are served as before."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gpuusage.kube.errors import ApiError
from gpuusage.kube.rest import RestClient
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.simulation import ensure_namespace
from tests.conftest import Kubectl, token_kubeconfig, wait_for

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "manifests" / "base" / "flowcontrol" / "agents.yaml"
NS, AGENT_SA, OPERATOR_SA = "gpuusage-system", "gpuusage-agent", "gpuusage-operator"
LEVEL = "gpuusage-agents"


def _dispatched(kubectl: Kubectl, flow_schema: str) -> float:
    """Requests the apiserver dispatched through this FlowSchema (its /metrics, as admin)."""
    text = kubectl.run("get", "--raw", "/metrics")
    pattern = re.compile(
        r'^apiserver_flowcontrol_dispatched_requests_total\{[^}]*flow_schema="'
        + re.escape(flow_schema)
        + r'"[^}]*\} (\S+)$',
        re.M,
    )
    return sum(float(v) for v in pattern.findall(text))


@pytest.fixture
def tokens(
    cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> Iterator[dict[str, Path]]:
    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    core = client.CoreV1Api(api)
    ensure_namespace(core, NS)
    for sa in (AGENT_SA, OPERATOR_SA):
        kubectl.run("create", "serviceaccount", sa, "-n", NS, check=False)  # may exist
    kubectl.run("apply", "-f", str(SHIPPED))
    custom = client.CustomObjectsApi(api)

    def bound() -> bool:
        schema = custom.get_cluster_custom_object(
            "flowcontrol.apiserver.k8s.io", "v1", "flowschemas", LEVEL
        )
        assert isinstance(schema, dict)
        found = (schema.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Dangling" and c.get("status") == "False" for c in found)

    wait_for(bound, what="the FlowSchema bound to its priority level")
    made = {
        name: token_kubeconfig(cluster, core, NS, sa, None, path=tmp_path / f"{name}.kubeconfig")
        for name, sa in (("agent", AGENT_SA), ("other-agent", AGENT_SA), ("operator", OPERATOR_SA))
    }
    try:
        yield made
    finally:
        kubectl.run("apply", "-f", str(SHIPPED))  # the shipped level again, after any tightening


@pytest.mark.cluster
def test_the_agents_requests_and_only_theirs_run_in_their_own_level(
    cluster: LocalCluster, tokens: dict[str, Path]
) -> None:
    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    agent, _ = RestClient.from_kubeconfig(tokens["agent"])
    operator, _ = RestClient.from_kubeconfig(tokens["operator"])
    with agent, operator:
        before = _dispatched(kubectl, LEVEL)
        for _ in range(20):
            agent.get("/version")
        assert _dispatched(kubectl, LEVEL) - before >= 20
        before = _dispatched(kubectl, LEVEL)
        for _ in range(20):
            operator.get("/version")
        assert _dispatched(kubectl, LEVEL) - before == 0, "the operator is not an agent"


@pytest.mark.cluster
def test_a_flood_from_one_agent_is_queued_and_refused_and_others_keep_working(
    api: client.ApiClient, cluster: LocalCluster, tokens: dict[str, Path]
) -> None:
    """The level tightened as an administrator might (one queue of two places, the least
    share): 48 threads of one agent's token flood it for five seconds. The flood is refused
    (429) and queued; the operator's ServiceAccount is served every time; another agent,
    retrying as the agent does, still gets its requests through."""
    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    tight = (
        '{"spec":{"limited":{"nominalConcurrencyShares":1,"limitResponse":'
        '{"queuing":{"queues":1,"handSize":1,"queueLengthLimit":2}}}}}'
    )
    kubectl.run("patch", "prioritylevelconfiguration", LEVEL, "--type=merge", "-p", tight)
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def flood() -> None:
        rest, _ = RestClient.from_kubeconfig(tokens["agent"])
        with rest:
            while not stop.is_set():
                try:
                    rest.get("/apis/gpuusage.io/v1alpha1/gpunodeusages/flood")
                    seen = "served"
                except ApiError as exc:
                    seen = "429" if "429" in str(exc) or "TooManyRequests" in str(exc) else "other"
                with lock:
                    outcomes[seen] += 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(48)]
    for thread in threads:
        thread.start()
    operator, _ = RestClient.from_kubeconfig(tokens["operator"])
    other, _ = RestClient.from_kubeconfig(tokens["other-agent"])
    slowest, through, tries = 0.0, 0, 0
    try:
        end = time.monotonic() + 5
        while time.monotonic() < end:
            started = time.monotonic()
            operator.get("/version")  # raises on any refusal
            slowest = max(slowest, time.monotonic() - started)
            tries += 1
            try:
                other.get("/version")
                through += 1
            except ApiError:
                pass
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        operator.close()
        other.close()
    print(f"flood: {dict(outcomes)}; operator slowest {slowest * 1000:.0f} ms;", end=" ")
    print(f"other agent {through}/{tries}")
    assert outcomes["429"] > 0, f"the flood was never refused: {dict(outcomes)}"
    assert slowest < 1.0, "the operator's requests were served as before"
    assert through > 0, "another agent still got requests through"
