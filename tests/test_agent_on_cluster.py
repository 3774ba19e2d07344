"""The agent against the real local control plane."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpuusage.api import names
from gpuusage_dev.localcluster.cluster import LocalCluster, free_port
from gpuusage_dev.proctree import write_process
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.settings import AgentSettings
from tests.conftest import CHILD_ENV, wait_for
from tests.examples import CTR_TRAIN, POD_TRAIN
from tests.fakenvml import gpu_uuid

pytestmark = pytest.mark.cluster

CGROUP = (
    f"0::/kubepods.slice/kubepods-pod{POD_TRAIN.replace('-', '_')}.slice/"
    f"cri-containerd-{CTR_TRAIN}.scope\n"
)


def _scenario(path: Path, used: list[int]) -> None:
    procs = [{"pid": 100 + i, "usedMemoryMiB": mib} for i, mib in enumerate(used)]
    path.write_text(
        yaml.safe_dump(
            {
                "gpus": [
                    {"index": 0, "uuid": gpu_uuid(0), "memoryTotalMiB": 81920, "processes": procs}
                ]
            }
        )
    )


def _at_least(read: Callable[[], float], value: float) -> bool:
    return read() >= value


def scraped(port: int, metric: str) -> float:
    """The agent's metric as its /metrics endpoint says, summed over its labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    samples = [x for x in text.splitlines() if x.startswith((metric + " ", metric + "{"))]
    return sum(float(x.split()[-1]) for x in samples)


class RunningAgent:
    def __init__(self, settings: AgentSettings) -> None:
        self.stop = threading.Event()
        self.result: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append(run_agent(settings, self.stop)), daemon=True
        )
        self.thread.start()

    def halt(self) -> int:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "agent did not stop"
        return self.result[0]


@pytest.fixture
def node(api: client.ApiClient) -> client.V1Node:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    return client.CoreV1Api(api).create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))


@dataclass(frozen=True)
class AgentSetup:
    """An agent's settings for a node of its own, over a fake GPU source the test rewrites."""

    settings: AgentSettings
    scenario: Path
    node: Any
    """The Node as created (a client.V1Node; typed Any as its optional fields are read as the
    apiserver fills them)."""


@pytest.fixture
def setup(tmp_path: Path, cluster: LocalCluster, node: client.V1Node) -> AgentSetup:
    proc = tmp_path / "proc"
    for i in range(3):
        write_process(proc, 100 + i, CGROUP, start_ticks=10 + i)
    scenario = tmp_path / "scenario.yaml"
    _scenario(scenario, [1000, 2000, 3000])
    assert node.metadata is not None
    settings = AgentSettings(
        node_name=str(node.metadata.name),
        interval=0.2,
        heartbeat=3600,
        gpu_source=f"fake:{scenario}",
        proc_root=proc,
        kubeconfig=cluster.kubeconfig,
        metrics_port=0,
    )
    return AgentSetup(settings, scenario, node)


def _get(api: client.ApiClient, name: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, name
    )
    assert isinstance(obj, dict)
    return obj


def test_agent_publishes_with_owner_reference_and_follows_changes(
    api: client.ApiClient, setup: AgentSetup
) -> None:
    name = setup.node.metadata.name
    agent = RunningAgent(setup.settings)
    try:
        obj = wait_for(lambda: _get(api, name), what="the CR")
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": name, "uid": setup.node.metadata.uid}
        ]
        procs = obj["spec"]["gpus"][0]["processes"]
        assert [p["containerID"] for p in procs] == [CTR_TRAIN] * 3
        assert [p["podUID"] for p in procs] == [POD_TRAIN] * 3
        # A process ends: the CR follows.
        _scenario(setup.scenario, [1000, 2000])
        wait_for(
            lambda: len(_get(api, name)["spec"]["gpus"][0]["processes"]) == 2,
            what="the ended process to disappear",
        )
    finally:
        assert agent.halt() == 0


def test_jitter_causes_no_write(api: client.ApiClient, setup: AgentSetup) -> None:
    name = setup.node.metadata.name
    port = free_port()
    settings = setup.settings.model_copy(
        update={"metrics_port": port, "metrics_address": "127.0.0.1"}
    )
    agent = RunningAgent(settings)

    def skipped() -> float:
        """Cycles the agent ran and decided not to write: the signal that it looked."""
        return scraped(port, "gpuusage_agent_writes_skipped_total")

    try:
        first = wait_for(lambda: _get(api, name), what="the CR")
        version = first["metadata"]["resourceVersion"]
        for used in ([1003, 1998, 3010], [1010, 2005, 2990], [995, 2030, 3001]):
            _scenario(setup.scenario, used)
            wait_for(partial(_at_least, skipped, skipped() + 3), what="three cycles")
        assert _get(api, name)["metadata"]["resourceVersion"] == version
        _scenario(setup.scenario, [1000, 2000, 4000])  # a real change
        wait_for(
            lambda: _get(api, name)["metadata"]["resourceVersion"] != version,
            what="the meaningful change to be written",
        )
    finally:
        agent.halt()


def test_spec_writes_never_touch_status(api: client.ApiClient, setup: AgentSetup) -> None:
    name = setup.node.metadata.name
    custom = client.CustomObjectsApi(api)
    agent = RunningAgent(setup.settings)
    try:
        wait_for(lambda: _get(api, name), what="the CR")
        status = {"totals": {"gpus": 1, "pods": 1, "processes": 3, "memory": "set-by-operator"}}
        custom.patch_cluster_custom_object_status(
            names.GROUP, names.VERSION, names.PLURAL, name, {"status": status}
        )
        _scenario(setup.scenario, [500])
        wait_for(lambda: len(_get(api, name)["spec"]["gpus"][0]["processes"]) == 1, what="update")
        assert _get(api, name)["status"]["totals"]["memory"] == "set-by-operator"
    finally:
        agent.halt()


def test_agent_survives_an_apiserver_restart_and_catches_up(
    api: client.ApiClient, cluster: LocalCluster, setup: AgentSetup
) -> None:
    name = setup.node.metadata.name
    port = free_port()
    agent = RunningAgent(
        setup.settings.model_copy(update={"metrics_port": port, "metrics_address": "127.0.0.1"})
    )
    try:
        wait_for(lambda: _get(api, name), what="the CR")
        cluster.stop_apiserver()
        _scenario(setup.scenario, [1000])  # changes while the API is away
        failed = partial(scraped, port, "gpuusage_agent_api_failures_total")
        wait_for(partial(_at_least, failed, 2), timeout=60, what="two failed writes")
        assert agent.thread.is_alive(), "the agent must not exit on a transient error"
        cluster.start_apiserver()
        wait_for(
            lambda: len(_get(api, name)["spec"]["gpus"][0]["processes"]) == 1,
            timeout=60,
            what="the agent to publish its latest observation after the restart",
        )
    finally:
        assert agent.halt() == 0


def test_once_publishes_and_exits(api: client.ApiClient, setup: AgentSetup) -> None:
    settings = setup.settings.model_copy(update={"once": True})
    assert run_agent(settings) == 0
    assert len(_get(api, setup.node.metadata.name)["spec"]["gpus"][0]["processes"]) == 3


def test_missing_node_is_a_failure_not_a_crash(cluster: LocalCluster, setup: AgentSetup) -> None:
    settings = setup.settings.model_copy(update={"once": True, "node_name": "no-such-node"})
    assert run_agent(settings) == 1


def test_agent_process_serves_metrics_and_stops_on_sigterm(
    api: client.ApiClient, setup: AgentSetup
) -> None:
    settings: AgentSettings = setup.settings
    port = free_port()
    env = {**CHILD_ENV, "NODE_NAME": settings.node_name}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuusage.cli",
            "agent",
            "--interval",
            "0.2",
            "--gpu-source",
            settings.gpu_source,
            "--proc-root",
            str(settings.proc_root),
            "--kubeconfig",
            str(settings.kubeconfig),
            "--metrics-port",
            str(port),
            "--metrics-address",
            "127.0.0.1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _get(api, settings.node_name), what="the CR")

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return str(r.read().decode())

        text = wait_for(
            lambda: (
                (t := scrape()) and 'gpuusage_agent_api_writes_total{verb="create"} 1.0' in t and t
            ),
            what="metrics",
        )
        assert "gpuusage_agent_cycle_duration_seconds_count" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            assert (r.status, r.read().decode().startswith("last cycle ")) == (200, True)
        assert "gpuusage_agent_processes 3.0" in text
        assert "gpuusage_agent_nvml_available 1.0" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "agent stopped" in err
    assert '"node_name": "' + settings.node_name in err, "effective settings logged at start"
