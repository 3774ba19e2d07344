"""A GPU Operator driver upgrade on the real node with the product installed as users install
it: while the Operator's label on the Node says the driver is being replaced, the agent holds
none of the driver's device files (its /proc/<pid>/fd, on the host) and its report says
DriverUpgrade; once the label moves on it holds them again and reads the GPUs, the same process,
never restarted. The fake driver holds its device files as NVML does (gpusource/fake)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuusage_dev.localcluster.node import DEFAULT_SCENARIO
from gpuusage_nodeagent.driverupgrade import UPGRADE_STATE_LABEL
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


def label(world: NodeWorld, state: str | None) -> None:
    world.core.patch_node(NAME, {"metadata": {"labels": {UPGRADE_STATE_LABEL: state}}})


def source(world: NodeWorld) -> dict[str, Any]:
    found: dict[str, Any] = node_report(world)["spec"]["source"]
    return found


def test_the_agent_holds_no_device_file_while_the_driver_is_replaced(world: NodeWorld) -> None:
    (world.scenario / "dev").mkdir()
    for name in DEVICE_FILES:
        (world.scenario / "dev" / name).touch()
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
