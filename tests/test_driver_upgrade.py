"""The agent lets go of the driver while the GPU Operator replaces it: which of its upgrade
states ask for that, the read of the agent's own Node, the device files the source holds, and
what the operator makes of such a report. Pure, or over files in a temporary folder."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage.api.models import GpuNodeUsageSpec, Source
from gpuusage.kube.errors import TransientApiError
from gpuusage_nodeagent.driverupgrade import RELEASING_STATES, UPGRADE_STATE_LABEL, upgrading
from gpuusage_nodeagent.gpusource.fake import FakeSource
from gpuusage_nodeagent.gpusource.releasing import ReleasingSource
from gpuusage_nodeagent.ownnode import UpgradeWatch
from gpuusage_operator.judge.certainty import REASON_UPGRADE, blind_spots, sees_all
from gpuusage_operator.judge.podstate import desired_condition, verdicts
from tests.builders import marked_snapshot
from tests.fakenvml import gpu_uuid

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
    expected = state if state in RELEASING else None
    assert upgrading({UPGRADE_STATE_LABEL: state}) == expected
    assert set(EVERY_STATE) >= RELEASING_STATES


def test_no_label_an_unknown_state_or_another_label_reads_the_gpus() -> None:
    assert upgrading({}) is None
    assert upgrading({UPGRADE_STATE_LABEL: "some-future-state"}) is None
    assert upgrading({"nvidia.com/gpu-driver-upgrade-state-x": "drain-required"}) is None
    assert upgrading({"other/label": "drain-required"}, "other/label") == "drain-required"


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
    assert watch.state() == "pod-deletion-required"
    assert len(api.paths) == 2


def test_a_failed_read_keeps_the_last_state() -> None:
    api, clock = NodeApi(), Clock()
    watch = UpgradeWatch(api.get, "n1", every=timedelta(seconds=1), clock=clock)
    api.labels[UPGRADE_STATE_LABEL] = "drain-required"
    assert watch.state() == "drain-required"
    api.failing, api.labels = True, {}
    clock.now += timedelta(seconds=1)
    assert watch.state() == "drain-required", "a failed read takes nothing back on a guess"
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
    source = ReleasingSource(FakeSource(scenario(tmp_path)), "fake", lambda: state[0], "l")
    assert source.read().source.available
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    state[0] = "pod-restart-required"
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
    back = source.read()
    assert back.source.available
    assert back.source.reason is None
    assert len(back.gpus) == 2
    assert held(tmp_path) == {"nvidiactl", "nvidia0", "nvidia1"}
    source.close()


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
