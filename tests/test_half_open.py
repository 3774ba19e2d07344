"""Timeouts and liveness on every call: between the operator and the apiserver, a TCP proxy
stops forwarding on every open connection without closing any (what a vanished peer or a
dropped NAT entry leaves: half-open connections). The operator notices within its stated
bounds (--api-timeout for a request, --watch-idle-timeout for a watch), connects again, lists
its pods again, and the pods' marks converge on what the node shows."""

from __future__ import annotations

import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.proctree import pod_cgroup, write_process
from gpuusage_dev.simulation import Background, create_running_pod
from gpuusage_operator.main import Operator
from gpuusage_operator.settings import OperatorSettings
from tests.conftest import GPU0, GPU1, WorldFactory, wait_for
from tests.tcpproxy import tcp_proxy
from tests.worldview import condition, pod

API_TIMEOUT = 3.0
WATCH_IDLE = 3.0


def _through(kubeconfig: Path, port: int, into: Path) -> Path:
    """The kubeconfig with its server behind the proxy (same certificates: 127.0.0.1)."""
    config = yaml.safe_load(kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{port}"
    into.write_text(yaml.safe_dump(config))
    return into


@pytest.mark.cluster
def test_half_open_connections_are_detected_and_the_marks_converge(
    cluster: LocalCluster, api: client.ApiClient, make_world: WorldFactory, tmp_path: Path
) -> None:
    world = make_world({"train": 1, "notebook": 1}, operator=False)
    server = urllib.parse.urlsplit(cluster.server)
    with tcp_proxy((server.hostname or "", server.port or 443)) as proxy:
        settings = OperatorSettings(
            kubeconfig=_through(cluster.kubeconfig, proxy.port, tmp_path / "proxied"),
            standalone=True,
            resync=0.5,
            stale_after=60,
            api_timeout=API_TIMEOUT,
            watch_idle_timeout=WATCH_IDLE,
        )
        operator = Operator(settings)
        ready = threading.Event()
        running = Background(lambda stop: operator.run(stop, ready))
        try:
            assert ready.wait(60), "operator did not become ready"
            wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="marked")
            relists = operator.pods.relists

            stalled = proxy.stall_existing()
            assert stalled >= 2, "the pod watch's and kopf's report watch's connections, at least"
            started = time.monotonic()
            # Meanwhile a new pod starts on GPU1 in the notebook's place (the agent writes past
            # the proxy): only a pod index that hears of it again can mark it.
            uid, cid = create_running_pod(world.core, world.ns, "late", world.node, "ctr")
            write_process(world.proc, 7070, pod_cgroup(uid, cid), comm="python3")
            gpu0 = [{"pid": 4242, "usedMemoryMiB": 30720}]
            world.scenario(
                [
                    {"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": gpu0},
                    {
                        "index": 1,
                        "uuid": GPU1,
                        "memoryTotalMiB": 81920,
                        "processes": [{"pid": 7070, "usedMemoryMiB": 2048}],
                    },
                ]
            )
            wait_for(
                lambda: (
                    condition(pod(world, "late")).status == "True"
                    and condition(pod(world, "notebook")).status == "False"
                ),
                timeout=60,
                what="the new pod marked and the notebook's use ended, through new connections",
            )
            took = time.monotonic() - started
            # A watch is found dead within its idle timeout, a request within its read
            # timeout; then new connections carry on. The bound, with room for the retries.
            bound = 2 * WATCH_IDLE + 3 * API_TIMEOUT + 10
            assert took < bound, f"converged after {took:.1f} s (bound {bound:.0f} s)"
            assert operator.pods.relists > relists, "the pod index was listed again"
            assert condition(pod(world, "train")).status == "True", "the rest stays true"
            print(f"half-open connections: marks converged after {took:.1f} s")
        finally:
            running.halt()
