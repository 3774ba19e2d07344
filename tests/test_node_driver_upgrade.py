"""A GPU Operator driver upgrade on the real node with the product installed as users install
it: while the Operator's labels on the Node say the driver is being replaced (the upgrade
controller's state, or the driver manager's `nvidia.com/gpu.deploy.client`), the agent holds
none of the driver's device files (its /proc/<pid>/fd, on the host) and its report says
DriverUpgrade; once the label moves on it holds them again and reads the GPUs: the same process,
never restarted, where the driver is back of the same version; a new container, after the agent
exited with its own status, where it is back of another version. What a GPU pod's tenant sees
meanwhile: a real pod whose real process the scenario puts on the GPU the kubelet gave it is in
use before, Unknown with the reason DriverUpgrade while the agent reads no GPU, in use again
after, its use never ended (a witness watches every condition and Event). The fake driver holds
its device files as NVML does, and refuses a library of another version as the kernel does
(gpusource/fake)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpuusage_dev.localcluster.node import DEFAULT_SCENARIO
from gpuusage_dev.localcluster.workloads import sleeper_deployment
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.driverupgrade import CLIENT_DEPLOY_LABEL, UPGRADE_STATE_LABEL
from gpuusage_nodeagent.main import EXIT_DRIVER_REPLACED
from gpuusage_nodeagent.podresources.kubelet import list_pods
from gpuusage_nodeagent.podresources.wire import list_response
from gpuusage_operator.judge.certainty import REASON_UPGRADE
from tests.conftest import wait_for
from tests.nodeworld import (
    NAME,
    NodeWorld,
    component,
    gpu_condition,
    host_pid,
    installed_world,
    node_report,
    running_pod,
    write_node_scenario,
)
from tests.witness import Witness

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

DEVICE_FILES = {"nvidiactl", "nvidia0", "nvidia1", "nvidia2", "nvidia3"}
GPUS: dict[str, Any] = {
    "gpus": [{**g, "minorNumber": g["index"]} for g in DEFAULT_SCENARIO["gpus"]],
}
NAMESPACE = "upgrade"
IN_USE = ("True", "ProcessesRunning")
UNKNOWN = ("Unknown", REASON_UPGRADE)


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


@pytest.fixture
def train(world: NodeWorld) -> Iterator[Any]:
    """A Deployment's pod on the GPU the kubelet gave it (its PodResources), its real process
    put there in the scenario, marked in use; removed afterwards, with its process and the
    upgrade label, so that the next test finds the node as it was."""
    ensure_namespace(world.core, NAMESPACE)
    wait_for(lambda: world.core.read_namespaced_service_account("default", NAMESPACE), what="SA")
    deployment: Any = sleeper_deployment("train", NAMESPACE, 1)
    apps = client.AppsV1Api(world.api)
    apps.create_namespaced_deployment(NAMESPACE, deployment)
    try:
        pod = wait_for(lambda: running_pod(world, NAMESPACE, "train"), timeout=90, what="train")
        socket = world.node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
        given = {p.name: p for p in list_response(list_pods(socket, 5))}[pod.metadata.name]
        (device,) = given.containers[0].devices[0].device_ids
        pid = host_pid(world, pod.status.container_statuses[0].container_id.split("://", 1)[1])
        write_node_scenario(world, {device: [{"pid": pid, "usedMemoryMiB": 4096}]})
        wait_for(
            lambda: shown(world, pod.metadata.name) == IN_USE, timeout=120, what="train in use"
        )
        yield pod
    finally:
        label(world, None)
        apps.delete_namespaced_deployment("train", NAMESPACE)
        wait_for(lambda: not world.core.list_namespaced_pod(NAMESPACE).items, timeout=90)
        write_node_scenario(world, {})


def shown(world: NodeWorld, pod: str) -> tuple[str, str] | None:
    """The pod's GPUInUse condition as its status and reason."""
    found = gpu_condition(world, NAMESPACE, pod)
    return None if found is None else (found["status"], found["reason"])


def went(witness: Witness, uid: str) -> list[tuple[str, str]]:
    """The pod's GPUInUse conditions the witness saw, in turn."""
    return [(s.status, s.reason) for s in witness.since(0) if s.uid == uid]


def test_a_pod_using_a_gpu_is_unknown_while_the_driver_is_replaced(
    world: NodeWorld, train: Any
) -> None:
    """What the pod's tenant sees: a GPU pod still on the node while the driver is replaced
    (its eviction not done yet) was in use, and its use is Unknown with the reason
    DriverUpgrade while the agent reads no GPU; in use again once the new driver is read. An
    agent that lets go of the driver does not say that the pods' processes ended: never False,
    and no Event but the one that said it started."""
    device_files(world)
    name, uid = train.metadata.name, train.metadata.uid
    witness = Witness(world.api, NAMESPACE).start()
    try:
        wait_for(lambda: witness.since(0), what="the witness's first list (train in use)")
        label(world, "cordon-required")  # the pods still run on the old driver
        label(world, "pod-deletion-required")
        leaving = time.monotonic()
        wait_for(lambda: shown(world, name) != IN_USE, timeout=60, what="train's mark changing")
        print(f"train's mark changed {time.monotonic() - leaving:.1f}s after pod-deletion-required")
        mark = shown(world, name)
        assert mark == UNKNOWN, f"train marked {mark} while the driver leaves"
        condition = gpu_condition(world, NAMESPACE, name)
        assert condition is not None
        assert "is being upgraded" in condition["message"]
        label(world, "pod-restart-required")
        wait_for(lambda: "pod-restart-required" in source(world)["message"], what="the next state")
        assert shown(world, name) == UNKNOWN, "still Unknown while the driver pod restarts"

        label(world, "validation-required")  # the new driver is loaded
        loaded = time.monotonic()
        wait_for(lambda: shown(world, name) == IN_USE, timeout=60, what="train in use again")
        print(f"train in use again {time.monotonic() - loaded:.1f}s after validation-required")
        wait_for(lambda: witness.reasons(uid), what="the witness hearing the pod's Events")
    finally:
        witness.stop()
    assert went(witness, uid) == [IN_USE, UNKNOWN, IN_USE], f"train went {went(witness, uid)}"
    assert witness.reasons(uid) == ["GPUUseStarted"], "its use never ended, nor started again"
    assert witness.wrong_marks({uid: "ProcessesRunning"}, {uid}) == []


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
