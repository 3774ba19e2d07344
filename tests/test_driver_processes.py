"""NVIDIA's own daemons hold GPUs: under MPS, the server is a driver process and the clients'
use is their own pods'. A tenant wearing the server's name is judged as any tenant."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pynvml
import pytest

from gpuusage_dev.proctree import pod_cgroup, write_process
from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.main import NodeReader
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_operator.judge.allocation import judgements
from gpuusage_operator.judge.freshness import Sighting, freshness
from gpuusage_operator.judge.resolution import pod_uses, resolve_all
from gpuusage_operator.judge.status import desired_status
from tests.builders import api_pod, pod_lookup
from tests.fakenvml import FakeGpu, FakeMachine, FakeProcess, gpu_uuid

NODE = "gpu-node-a"

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
DAEMON_UID, DAEMON_CID = "aaaaaaaa-0000-4000-8000-000000000001", "a" * 64
CLIENT_UID, CLIENT_CID = "bbbbbbbb-0000-4000-8000-000000000002", "b" * 64
SNEAKY_UID, SNEAKY_CID = "cccccccc-0000-4000-8000-000000000003", "c" * 64
SERVER = b"/usr/bin/nvidia-cuda-mps-server"


def _mps_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sneaky_server: bool = False
) -> NodeReader:
    """What NVML returns under MPS (Volta+): the server in the compute list, holding its
    context; each client in the MPS list with its own pid and memory."""
    procs = [
        FakeProcess(pid=300, used_mib=420, name=SERVER),
        FakeProcess(pid=301, used_mib=2048, kinds=("mps",)),
    ]
    write_process(tmp_path, 300, pod_cgroup(DAEMON_UID, DAEMON_CID), comm="nvidia-cuda-mps")
    write_process(tmp_path, 301, pod_cgroup(CLIENT_UID, CLIENT_CID), comm="python3")
    if sneaky_server:
        procs.append(FakeProcess(pid=302, used_mib=8192, name=SERVER))
        write_process(tmp_path, 302, pod_cgroup(SNEAKY_UID, SNEAKY_CID), comm="nvidia-cuda-mps")
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0), reserved_mib=530, processes=procs)])
    machine.install(monkeypatch)
    return NodeReader(NODE, NvmlSource(pynvml), Resolver(tmp_path), clock=lambda: NOW)


def test_the_mps_server_is_a_driver_process_and_clients_are_their_pods(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = _mps_node(monkeypatch, tmp_path).read().spec()
    gpu = spec.gpus[0]
    assert gpu.error is None, "the server's and the clients' memory explain the device's"
    assert {p.pid: (p.name, tuple(p.types)) for p in gpu.processes} == {
        300: ("nvidia-cuda-mps-server", ("compute",)),
        301: ("python3.11", ("mps",)),
    }
    pods = pod_lookup(
        api_pod("mps-control-daemon", DAEMON_UID, {"mps": DAEMON_CID}, ns="gpu-operator", gpus=0),
        api_pod("client", CLIENT_UID, {"main": CLIENT_CID}),
    )
    resolutions = list(resolve_all(spec, pods))
    by_pid = {r.process.pid: r for r in resolutions}
    assert by_pid[300].reason == "DriverProcess"
    assert by_pid[300].pod is None
    assert "gpu-operator/mps-control-daemon" in by_pid[300].message
    assert by_pid[301].pod is not None
    assert by_pid[301].pod.name == "client"
    uses = pod_uses(NODE, NOW, resolutions)
    assert list(uses) == [CLIENT_UID], "the daemon's pod uses no GPU of its own"
    assert judgements(uses, spec)[CLIENT_UID].finding is None
    status = desired_status(
        spec, resolutions, NOW, generation=1, fresh=freshness(Sighting(1, NOW), None, None, NOW)
    )
    assert status.totals is not None
    assert (status.totals.unrequested_pods, status.totals.unattributed_processes) == (0, 0)
    assert [(u.pid, u.reason) for u in status.unattributed] == [(300, "DriverProcess")]
    assert status.devices[0].unattributed_memory_mib == 0


def test_a_tenant_named_like_the_mps_server_is_judged_as_a_tenant(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = _mps_node(monkeypatch, tmp_path, sneaky_server=True).read().spec()
    pods = pod_lookup(
        api_pod("mps-control-daemon", DAEMON_UID, {"mps": DAEMON_CID}, ns="gpu-operator", gpus=0),
        api_pod("client", CLIENT_UID, {"main": CLIENT_CID}),
        api_pod("sneaky", SNEAKY_UID, {"main": SNEAKY_CID}, gpus=0),
    )
    resolutions = list(resolve_all(spec, pods))
    uses = pod_uses(NODE, NOW, resolutions)
    assert judgements(uses, spec)[SNEAKY_UID].finding == "Unrequested"
    # The host's own MPS server (started by systemd) is a driver process too.
    host = spec.model_copy(
        update={
            "gpus": [
                spec.gpus[0].model_copy(
                    update={
                        "processes": [
                            p.model_copy(update={"container_id": None, "pod_uid": None})
                            for p in spec.gpus[0].processes
                            if p.pid == 300
                        ]
                    }
                )
            ]
        }
    )
    assert [r.reason for r in resolve_all(host, pod_lookup())] == ["DriverProcess"]
