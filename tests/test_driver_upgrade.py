"""The agent lets go of the driver while the GPU Operator replaces it: which of its upgrade
states and GPU-client labels ask for that, the read of the agent's own Node, the device files
the source holds, the agent's end when the driver comes back of another version than its
library, and what the operator makes of such a report. Pure, over files in a temporary folder,
or through the real NVML code path with pynvml's functions faked."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from gpuusage.api.models import GpuNodeUsageSpec, Source
from gpuusage.kube.errors import TransientApiError
from gpuusage_nodeagent import main
from gpuusage_nodeagent.change import Decision
from gpuusage_nodeagent.driverupgrade import (
    CLIENT_DEPLOY_LABEL,
    RELEASING_STATES,
    UPGRADE_STATE_LABEL,
    releasing,
)
from gpuusage_nodeagent.gpusource.base import GpuSource
from gpuusage_nodeagent.gpusource.fake import FakeSource
from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.gpusource.releasing import ReleasingSource
from gpuusage_nodeagent.gpusource.replaced import MISMATCH_LASTING, DriverReplaced
from gpuusage_nodeagent.main import NodeReader, run_cycles
from gpuusage_nodeagent.metrics import AgentMetrics
from gpuusage_nodeagent.ownnode import WATCHFUL_EVERY, WATCHFUL_FOR, UpgradeWatch
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.judge.certainty import REASON_UPGRADE, blind_spots, sees_all
from gpuusage_operator.judge.podstate import desired_condition, verdicts
from tests.builders import marked_snapshot
from tests.fakenvml import FakeGpu, FakeMachine, gpu_uuid

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)

# k8s-operator-libs pkg/upgrade/consts.go, every state the controller writes
EVERY_STATE = (
    "upgrade-required",
    "cordon-required",
    "wait-for-jobs-required",
    "pod-deletion-required",
    "drain-required",
    "node-maintenance-required",
    "post-maintenance-required",
    "pod-restart-required",
    "validation-required",
    "uncordon-required",
    "upgrade-done",
    "upgrade-failed",
)
RELEASING = {
    "pod-deletion-required",
    "drain-required",
    "node-maintenance-required",
    "post-maintenance-required",
    "pod-restart-required",
}


@pytest.mark.parametrize("state", EVERY_STATE)
def test_the_driver_is_let_go_from_pod_deletion_until_the_new_driver_is_loaded(state: str) -> None:
    expected = f"{UPGRADE_STATE_LABEL}={state}" if state in RELEASING else None
    assert releasing({UPGRADE_STATE_LABEL: state}) == expected
    assert set(EVERY_STATE) >= RELEASING_STATES


def test_no_label_an_unknown_state_or_another_label_reads_the_gpus() -> None:
    assert releasing({}) is None
    assert releasing({UPGRADE_STATE_LABEL: "some-future-state"}) is None
    assert releasing({"nvidia.com/gpu-driver-upgrade-state-x": "drain-required"}) is None
    assert releasing({"other/label": "drain-required"}, "other/label") == (
        "other/label=drain-required"
    )


@pytest.mark.parametrize(
    ("value", "lets_go"),
    [
        # k8s-driver-manager's maybeSetPaused / maybeSetTrue, mig-parted's reconfigure
        ("true", False),
        ("paused-for-driver-upgrade", True),
        ("paused-for-mig-change", True),
        ("custom_paused-for-driver-upgrade", True),  # a value other than true, paused
        ("custom", False),
        ("false", False),  # no clients wanted here: the managers leave it as it is
        ("", False),
    ],
)
def test_the_gpu_clients_deploy_label_lets_go_while_it_says_paused(
    value: str, lets_go: bool
) -> None:
    expected = f"{CLIENT_DEPLOY_LABEL}={value}" if lets_go else None
    assert releasing({CLIENT_DEPLOY_LABEL: value}) == expected
    both = {UPGRADE_STATE_LABEL: "pod-restart-required", CLIENT_DEPLOY_LABEL: value}
    assert releasing(both) == f"{UPGRADE_STATE_LABEL}=pod-restart-required", "either is enough"
    state = {UPGRADE_STATE_LABEL: "upgrade-done", CLIENT_DEPLOY_LABEL: value}
    assert releasing(state) == expected, "an upgrade state that reads the GPUs does not override"


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


class NodeApi:
    """The agent's Node as the apiserver would answer a GET of it."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {}
        self.paths: list[str] = []
        self.failing = False

    def get(self, path: str) -> dict[str, Any]:
        self.paths.append(path)
        if self.failing:
            raise TransientApiError("no answer")
        return {"metadata": {"name": "n1", "labels": dict(self.labels)}}


def test_the_node_is_read_at_most_once_every_interval_from_the_cache() -> None:
    api, clock = NodeApi(), Clock()
    watch = UpgradeWatch(api.get, "n1", every=timedelta(seconds=30), clock=clock)
    assert watch.state() is None
    api.labels[UPGRADE_STATE_LABEL] = "pod-deletion-required"
    clock.now += timedelta(seconds=29)
    assert watch.state() is None, "not read again before the interval"
    assert api.paths == ["/api/v1/nodes/n1?resourceVersion=0"]
    clock.now += timedelta(seconds=1)
    assert watch.state() == f"{UPGRADE_STATE_LABEL}=pod-deletion-required"
    assert len(api.paths) == 2
    api.labels = {CLIENT_DEPLOY_LABEL: "paused-for-mig-change"}
    clock.now += timedelta(seconds=30)
    assert watch.state() == f"{CLIENT_DEPLOY_LABEL}=paused-for-mig-change"


def test_soon_after_a_pause_the_node_is_read_often_then_as_before() -> None:
    """The driver manager alone (no upgrade controller) sets `true` again when its unload
    fails and pauses again at its next try, maybe for seconds: for a while after the last
    pause seen the Node is read every WATCHFUL_EVERY, then every interval again."""
    api, clock = NodeApi(), Clock()
    watch = UpgradeWatch(api.get, "n1", every=timedelta(seconds=30), clock=clock)
    api.labels[CLIENT_DEPLOY_LABEL] = "paused-for-driver-upgrade"
    assert watch.state() is not None
    api.labels[CLIENT_DEPLOY_LABEL] = "true"  # its unload failed: it tries again later
    clock.now += WATCHFUL_EVERY
    assert watch.state() is None, "read again within seconds"
    api.labels[CLIENT_DEPLOY_LABEL] = "paused-for-driver-upgrade"  # its next try
    clock.now += WATCHFUL_EVERY
    assert watch.state() is not None, "the second pause seen within seconds too"
    api.labels[CLIENT_DEPLOY_LABEL] = "true"
    clock.now += WATCHFUL_EVERY
    assert watch.state() is None
    clock.now += WATCHFUL_FOR
    reads = len(api.paths)
    watch.state()
    clock.now += WATCHFUL_EVERY
    watch.state()
    assert len(api.paths) == reads + 1, "long after the last pause, once every interval again"


def test_a_failed_read_keeps_the_last_state() -> None:
    api, clock = NodeApi(), Clock()
    watch = UpgradeWatch(api.get, "n1", every=timedelta(seconds=1), clock=clock)
    api.labels[UPGRADE_STATE_LABEL] = "drain-required"
    assert watch.state() == f"{UPGRADE_STATE_LABEL}=drain-required"
    api.failing, api.labels = True, {}
    clock.now += timedelta(seconds=1)
    assert watch.state() == f"{UPGRADE_STATE_LABEL}=drain-required", (
        "a failed read takes nothing back on a guess"
    )
    api.failing = False
    clock.now += timedelta(seconds=1)
    assert watch.state() is None


def held(folder: Path) -> set[str]:
    """The files under `folder` this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.add(Path(target).name)
    return found


def scenario(tmp_path: Path, **extra: Any) -> Path:
    path = tmp_path / "gpus.yaml"
    gpus = [
        {"index": i, "uuid": gpu_uuid(i), "memoryTotalMiB": 81559, "minorNumber": i}
        for i in range(2)
    ]
    path.write_text(yaml.safe_dump({"gpus": gpus, **extra}))
    return path


def test_the_fake_driver_holds_its_device_files_while_the_library_works(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia7"):
        (tmp_path / "dev" / name).touch()
    source = FakeSource(scenario(tmp_path))
    assert held(tmp_path) == set(), "nothing held before the first reading"
    source.read()
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    scenario(tmp_path, nvmlError="DriverNotLoaded")
    source.read()
    assert held(tmp_path) == set(), "a driver gone is let go"
    scenario(tmp_path)
    source.read()
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    source.close()
    assert held(tmp_path) == set()


def test_an_upgrade_lets_go_of_the_driver_and_the_agent_comes_back_by_itself(
    tmp_path: Path,
) -> None:
    (tmp_path / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1"):
        (tmp_path / "dev" / name).touch()
    state: list[str | None] = [None]
    source = ReleasingSource(FakeSource(scenario(tmp_path)), "fake", lambda: state[0])
    assert source.read().source.available
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    state[0] = f"{UPGRADE_STATE_LABEL}=pod-restart-required"
    reading = source.read()
    assert held(tmp_path) == set()
    assert (reading.source.available, reading.source.reason) == (False, "DriverUpgrade")
    assert reading.source.kind == "fake"
    assert reading.gpus == []
    assert reading.source.message is not None
    assert "pod-restart-required" in reading.source.message
    source.poll()
    source.sample_shares({gpu_uuid(0)}, 1.0)
    assert held(tmp_path) == set(), "nothing between two readings takes it back"
    state[0] = None
    assert source.read().source.available
    state[0] = f"{CLIENT_DEPLOY_LABEL}=paused-for-driver-upgrade"
    source.poll()  # between two readings: let go at once, not at the next reading
    assert held(tmp_path) == set()
    assert source.released == state[0]
    state[0] = None
    back = source.read()
    assert back.source.available
    assert back.source.reason is None
    assert len(back.gpus) == 2
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    source.close()


def nvml_reader(
    machine: FakeMachine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[NodeReader, list[str | None]]:
    """An agent's reader over `machine` through the real NVML code path, letting go of the
    driver while the returned list's one item names a cause."""
    machine.install(monkeypatch)
    cause: list[str | None] = [None]
    source = ReleasingSource(NvmlSource(pynvml, clock=machine.now), "nvml", lambda: cause[0])
    return NodeReader("n1", source, Resolver(tmp_path), clock=machine.now), cause


def let_go_while_replaced(
    machine: FakeMachine, cause: list[str | None], reader: NodeReader
) -> None:
    """The GPU Operator's upgrade: the agent lets go, the module is replaced meanwhile."""
    cause[0] = f"{UPGRADE_STATE_LABEL}=pod-restart-required"
    assert reader.read().reading.source.reason == "DriverUpgrade"
    assert not machine.initialised


def went_away_while_replaced(
    machine: FakeMachine, cause: list[str | None], reader: NodeReader
) -> None:
    """No Operator: the module is unloaded under the agent, which notices it at a reading."""
    machine.gpus[0].handle_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert reader.read().reading.gpus[0].error is not None
    assert not machine.initialised, "NVML shut down at once"
    machine.gpus[0].handle_error = None
    machine.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert not reader.read().reading.source.available, "no driver loaded for a while"
    machine.init_error = None


REPLACEMENTS = [let_go_while_replaced, went_away_while_replaced]
Replacement = Callable[[FakeMachine, list[str | None], NodeReader], None]


@pytest.mark.parametrize("replaced", REPLACEMENTS, ids=["upgrade-label", "driver-gone"])
def test_a_driver_back_of_the_same_version_is_read_by_the_same_process(
    replaced: Replacement, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0))], driver="550.54.15")
    reader, cause = nvml_reader(machine, monkeypatch, tmp_path)
    assert reader.read().reading.source.available
    replaced(machine, cause, reader)
    cause[0] = None
    back = reader.read().reading
    assert back.source.available
    assert back.source.driver_version == "550.54.15"
    assert machine.initialised


@pytest.mark.parametrize("replaced", REPLACEMENTS, ids=["upgrade-label", "driver-gone"])
def test_a_driver_back_of_another_version_ends_the_agent_rather_than_idling_for_ever(
    replaced: Replacement, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pynvml keeps the library it loaded first, the old driver's: the new module refuses it
    (LibRmVersionMismatch) for as long as it stays loaded, so only a new process reads it."""
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0))], driver="550.54.15")
    reader, cause = nvml_reader(machine, monkeypatch, tmp_path)
    assert reader.read().reading.source.available
    replaced(machine, cause, reader)
    machine.driver = "580.159.04"
    cause[0] = None
    with pytest.raises(DriverReplaced, match=r"driver 550\.54\.15's"):
        reader.read()
    assert not machine.initialised
    fresh = NvmlSource(pynvml)  # a new container's process, given the new driver's library
    machine.library = machine.driver
    assert fresh.read().source.driver_version == "580.159.04"


def test_a_mismatch_from_the_start_idles_says_so_and_ends_once_it_lasts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A library that never worked here: the agent reports why, and once that has lasted
    MISMATCH_LASTING it ends, for a container with the node's current libraries (one created
    while they were still the old driver's is mended so)."""
    machine = FakeMachine([FakeGpu(uuid=gpu_uuid(0))], driver="580.159.04")
    machine.library = "550.54.15"
    reader, _ = nvml_reader(machine, monkeypatch, tmp_path)
    for _ in range(2):
        reading = reader.read().reading
        assert not reading.source.available
        assert reading.errors["LibRmVersionMismatch"] == 1
        assert reading.source.message is not None
        assert "LibRmVersionMismatch" in reading.source.message
        machine.tick(MISMATCH_LASTING.total_seconds() / 2 - 1)
    machine.tick(2)
    with pytest.raises(DriverReplaced, match="since it started"):
        reader.read()


def test_the_fake_driver_refuses_its_library_once_replaced_by_another_version(
    tmp_path: Path,
) -> None:
    (tmp_path / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1"):
        (tmp_path / "dev" / name).touch()
    source = FakeSource(scenario(tmp_path, driverVersion="550.54.15"))
    assert source.read().source.available
    scenario(tmp_path, driverVersion="580.159.04")
    reading = source.read()
    assert (reading.source.available, reading.gpus) == (False, [])
    assert reading.errors == {"LibRmVersionMismatch": 1}
    assert held(tmp_path) == set(), "a library the module refuses holds no device file"
    fresh = FakeSource(tmp_path / "gpus.yaml")  # a new process: the new driver's library
    assert fresh.read().source.driver_version == "580.159.04"
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    fresh.close()


def test_the_agent_loop_ends_when_the_driver_comes_back_of_another_version(
    tmp_path: Path,
) -> None:
    path = scenario(tmp_path, driverVersion="550.54.15")
    stop = threading.Event()
    offered: list[bool] = []

    class Recorder:
        def offer(self, attributed: Any, force: bool = False) -> Decision:
            offered.append(attributed.reading.source.available)
            if len(offered) == 1:
                scenario(tmp_path, driverVersion="580.159.04")  # replaced by another version
            if len(offered) > 3:
                stop.set()  # today's failure: idling on, never ending
            return Decision(True, "report")

    settings = AgentSettings(node_name="n1", interval=0.01, metrics_port=0)
    source: GpuSource = FakeSource(path)
    reader = NodeReader("n1", source, Resolver(tmp_path))
    with pytest.raises(DriverReplaced, match=r"driver 550\.54\.15's"):
        run_cycles(settings, reader, Recorder(), AgentMetrics(), stop)  # type: ignore[arg-type]
    assert offered == [True], "the cycle that read the mismatch published nothing"


def test_the_agent_exits_with_its_own_status_when_the_driver_was_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def replaced(*_: Any) -> int:
        raise DriverReplaced("550.54.15", "NVML unavailable (LibRmVersionMismatch)")

    monkeypatch.setattr(main, "_loop", replaced)
    settings = AgentSettings(
        node_name="n1",
        gpu_source=f"fake:{scenario(tmp_path)}",
        proc_root=tmp_path,
        metrics_port=0,
    )
    assert main.run_agent(settings) == main.EXIT_DRIVER_REPLACED != 0
    assert "the agent exits so that its container is created again" in caplog.text


def test_the_operator_makes_the_pods_use_unknown_with_the_reason_never_ended() -> None:
    spec = GpuNodeUsageSpec(
        node_name="n1",
        observed_at=NOW,
        source=Source(kind="nvml", available=False, reason="DriverUpgrade", message="upgrading"),
    )
    blind = blind_spots(spec, [])
    assert blind.everywhere is not None
    assert blind.everywhere.reason == REASON_UPGRADE
    assert not sees_all(blind, None), "nothing idle while upgrading"
    pod = marked_snapshot(gpu_uuid(0))
    (verdict,) = verdicts({}, [pod], [], stale=False, blind=blind)
    assert verdict.state == "Unknown"
    condition = desired_condition("Unknown", None, "n1", unknown=verdict.unknown)
    assert (condition["status"], condition["reason"]) == ("Unknown", "DriverUpgrade")
    assert "upgrading" not in condition["message"], "the agent's words stay in the report"
    failed = spec.model_copy(update={"source": Source(kind="nvml", available=False)})
    cause = blind_spots(failed, []).everywhere
    assert cause is not None
    assert cause.reason == "DeviceNotReadable", "only the reason says so"
