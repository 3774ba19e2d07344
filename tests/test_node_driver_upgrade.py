"""A GPU Operator driver upgrade on the real node with the product installed as users install
it: while the Operator's labels on the Node say the driver is being replaced (the upgrade
controller's state, or the driver manager's `nvidia.com/gpu.deploy.client`), the agent holds
none of the driver's device files (its /proc/<pid>/fd, on the host) and its report says
DriverUpgrade; once the label moves on it holds them again and reads the GPUs: the same process,
never restarted, where the driver is back of the same version; a new container, after the agent
exited with its own status, where it is back of another version. The fake driver holds its
device files as NVML does, and refuses a library of another version as the kernel does
(gpusource/fake)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage_dev.localcluster.node import DEFAULT_SCENARIO
from gpuusage_nodeagent.driverupgrade import CLIENT_DEPLOY_LABEL, UPGRADE_STATE_LABEL
from gpuusage_nodeagent.main import EXIT_DRIVER_REPLACED
from tests.conftest import wait_for
from tests.nodeworld import NAME, NodeWorld, component, installed_world, node_report

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

DEVICE_FILES = {"nvidiactl", "nvidia0", "nvidia1", "nvidia2", "nvidia3"}
GPUS: dict[str, Any] = {
    "gpus": [{**g, "minorNumber": g["index"]} for g in DEFAULT_SCENARIO["gpus"]],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeWorld]:
    yield from installed_world(
        tmp_path_factory.mktemp("driver-upgrade"),
        agent_args=("--interval", "1", "--driver-upgrade-read-every", "1"),
        gpus=GPUS,
    )


def held(pid: int) -> set[str]:
    """The driver's device files the process holds open (their names)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if Path(target).name.startswith("nvidia") and "/dev/" in target:
            found.add(Path(target).name)
    return found


def label(world: NodeWorld, state: str | None, key: str = UPGRADE_STATE_LABEL) -> None:
    world.core.patch_node(NAME, {"metadata": {"labels": {key: state}}})


def device_files(world: NodeWorld) -> None:
    (world.scenario / "dev").mkdir(exist_ok=True)
    for name in DEVICE_FILES:
        (world.scenario / "dev" / name).touch()


def source(world: NodeWorld) -> dict[str, Any]:
    found: dict[str, Any] = node_report(world)["spec"]["source"]
    return found


def test_the_agent_holds_no_device_file_while_the_driver_is_replaced(world: NodeWorld) -> None:
    device_files(world)
    pod, pid = component(world, "agent")
    restarts = pod.status.container_statuses[0].restart_count
    wait_for(lambda: held(pid) == DEVICE_FILES, what="the agent holding the driver's files")
    assert source(world)["available"] is True

    label(world, "cordon-required")  # the GPU pods still run: the agent keeps reading
    label(world, "pod-deletion-required")
    wait_for(lambda: source(world).get("reason") == "DriverUpgrade", what="the report saying so")
    assert held(pid) == set(), "no device file held once the report says DriverUpgrade"
    paused = source(world)
    assert paused["available"] is False
    assert "pod-deletion-required" in paused["message"]
    assert node_report(world)["spec"].get("gpus", []) == []
    label(world, "pod-restart-required")
    wait_for(lambda: "pod-restart-required" in source(world)["message"], what="the next state read")
    assert held(pid) == set(), "none while the driver pod restarts"

    label(world, "validation-required")  # the new driver is loaded
    wait_for(lambda: source(world)["available"] is True, what="the agent reading the GPUs again")
    wait_for(lambda: held(pid) == DEVICE_FILES, what="the agent holding the new driver's files")
    assert len(node_report(world)["spec"]["gpus"]) == len(GPUS["gpus"])
    label(world, None)
    again, same = component(world, "agent")
    assert same == pid, "the same agent process, never restarted"
    assert again.status.container_statuses[0].restart_count == restarts


def test_a_driver_back_of_another_version_restarts_the_agent_with_it(world: NodeWorld) -> None:
    """The driver manager's label, and a driver replaced by another version meanwhile: the
    agent's process cannot read it (its library is the old driver's), so it exits and the
    kubelet starts its container again."""
    device_files(world)
    pod, pid = component(world, "agent")
    restarts = pod.status.container_statuses[0].restart_count
    wait_for(lambda: held(pid) == DEVICE_FILES, what="the agent holding the driver's files")
    label(world, "true", CLIENT_DEPLOY_LABEL)  # as the GPU Operator labels its GPU nodes
    label(world, "paused-for-driver-upgrade", CLIENT_DEPLOY_LABEL)
    wait_for(lambda: source(world).get("reason") == "DriverUpgrade", what="the report saying so")
    assert held(pid) == set(), "no device file held once the report says DriverUpgrade"
    assert f"{CLIENT_DEPLOY_LABEL}=paused-for-driver-upgrade" in source(world)["message"]

    path = world.scenario / "gpus.yaml"
    scenario = yaml.safe_load(path.read_text())
    staged = world.scenario / "gpus.new"
    staged.write_text(yaml.safe_dump({**scenario, "driverVersion": "580.159.04"}))
    staged.replace(path)  # the new driver, of another version, is loaded
    label(world, "true", CLIENT_DEPLOY_LABEL)

    def restarted() -> Any:
        found = world.core.read_namespaced_pod(pod.metadata.name, "gpuusage-system")
        status = found.status.container_statuses[0]
        return status if status.restart_count > restarts and status.ready else None

    replaced_at = time.monotonic()
    status = wait_for(restarted, timeout=120, what="the agent's container started again")
    assert status.last_state.terminated.exit_code == EXIT_DRIVER_REPLACED
    _, again = component(world, "agent")
    assert again != pid
    wait_for(
        lambda: source(world).get("driverVersion") == "580.159.04" and source(world)["available"],
        timeout=60,
        what="the new agent reading the new driver",
    )
    print(f"the new driver read {time.monotonic() - replaced_at:.1f}s after the label said true")
    wait_for(lambda: held(again) == DEVICE_FILES, what="the new agent holding the driver's files")
    # The kubelet's file of the exited container (its restart count names it).
    folder = f"gpuusage-system_{pod.metadata.name}_{pod.metadata.uid}"
    logs = (world.node.directory / "pod-logs" / folder / "agent" / f"{restarts}.log").read_text()
    assert "replaced by one of another version" in logs
    label(world, None, CLIENT_DEPLOY_LABEL)
