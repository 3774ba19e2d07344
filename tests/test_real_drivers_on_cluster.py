"""What real drivers and runtimes do, driven through the real agent and operator on the real
local control plane: what a person reads on the pods stays true."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import GPU0, GPU1, WorldFactory, wait_for
from tests.simworld import SimWorld
from tests.worldview import condition, events, pod, report

pytestmark = pytest.mark.cluster


def _reason(world: SimWorld, name: str) -> tuple[str, str]:
    found = condition(pod(world, name))
    return str(found.status), str(found.reason)


def _devices(world: SimWorld) -> dict[str, str | None]:
    status = report(world).get("status") or {}
    return {d["uuid"]: d.get("blind") for d in status.get("devices") or []}


def test_a_device_that_lists_too_few_processes_never_ends_use(make_world: WorldFactory) -> None:
    """NVML stops listing train's process (a driver that cannot map its pid into the agent's
    namespace) while GPU 0's memory still counts it: train is Unknown with
    ProcessesNotVisible, not ended, no GPUUseEnded Event; the status names the blind device
    and the notebook on GPU 1 is judged as ever. Once the memory goes too, use has ended."""
    world = make_world()
    wait_for(lambda: _reason(world, "train") == ("True", "ProcessesRunning"), what="train")
    wait_for(lambda: _reason(world, "notebook")[0] == "True", what="notebook in use")
    xorg = {"pid": 777, "usedMemoryMiB": 512}
    notebook = {"pid": 5151, "usedMemoryMiB": 10240}

    def gpus(train_hidden_mib: int) -> list[dict[str, Any]]:
        gpu0: dict[str, Any] = {"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920}
        gpu0["processes"] = [xorg]
        if train_hidden_mib:
            gpu0["memoryUsedMiB"] = 512 + train_hidden_mib
        gpu1 = {"index": 1, "uuid": GPU1, "memoryTotalMiB": 81920, "processes": [notebook]}
        return [gpu0, gpu1]

    world.scenario(gpus(train_hidden_mib=30720))
    wait_for(
        lambda: _reason(world, "train") == ("Unknown", "ProcessesNotVisible"),
        what="train's use unknown, not ended",
    )
    message = str(condition(pod(world, "train")).message)
    assert GPU0 in message
    assert "processes the node agent cannot see" in message
    assert "NVML" not in message, "the agent's error message stays in the report"
    # the status is written after the pods in the same reconcile: wait for it
    wait_for(
        lambda: _devices(world) == {GPU0: "ProcessesNotVisible", GPU1: None},
        what="the status naming the blind device",
    )
    assert report(world)["status"]["totals"]["blindDevices"] == 1
    assert _reason(world, "notebook") == ("True", "ProcessesRunning")
    assert events(world, "train") == ["GPUUseStarted"], "no end, no Event pair"

    world.scenario(gpus(train_hidden_mib=0))
    wait_for(lambda: _reason(world, "train") == ("False", "ProcessesEnded"), what="train ended")
    wait_for(lambda: events(world, "train") == ["GPUUseEnded", "GPUUseStarted"], what="one end")
    wait_for(lambda: _devices(world) == {GPU0: None, GPU1: None}, what="no blind device")
