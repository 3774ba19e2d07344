"""Where a report cannot see, and what that means for pods it no longer shows. Pure."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuusage.api import names
from gpuusage.api.models import DeviceError, GpuNodeUsageSpec, Process, Source
from gpuusage_operator.index.pods import PodLookup
from gpuusage_operator.judge.certainty import (
    REASON_DEVICE,
    REASON_UNRESOLVED,
    blind_spots,
    why_unknown,
)
from gpuusage_operator.judge.podstate import desired_condition
from gpuusage_operator.judge.resolution import resolve_all
from gpuusage_operator.writers.marks import event_for
from tests.builders import marked_snapshot
from tests.examples import CTR_TRAIN, POD_TRAIN, example_spec

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
SPEC = example_spec("n1", NOW)
GPU0 = SPEC.gpus[0].uuid or ""
GPU1 = SPEC.gpus[1].uuid or ""
MIG = SPEC.gpus[1].mig_devices[0].uuid
NOBODY = PodLookup()


def test_a_report_that_sees_everything_ends_use() -> None:
    blind = blind_spots(SPEC, resolve_all(SPEC, NOBODY))
    assert not blind
    assert why_unknown(marked_snapshot(GPU0), blind) is None


def test_an_unreadable_device_makes_the_use_of_its_pods_unknown() -> None:
    lost = SPEC.gpus[1].model_copy(
        update={"error": DeviceError(reason="GpuIsLost", message="fell off the bus")}
    )
    spec = SPEC.model_copy(update={"gpus": [SPEC.gpus[0], lost]})
    blind = blind_spots(spec, resolve_all(spec, NOBODY))
    on_mig = why_unknown(marked_snapshot(MIG), blind)
    assert on_mig is not None, "a MIG device of a lost GPU is lost too"
    assert on_mig.reason == REASON_DEVICE
    # what the agent wrote about the device stays in the report: never on a tenant's pod
    assert "fell off the bus" not in on_mig.message
    assert "GpuIsLost" not in on_mig.message
    assert "spec.gpus[].error says why" in on_mig.message
    assert why_unknown(marked_snapshot(GPU0), blind) is None, "the readable GPU still tells"
    assert why_unknown(marked_snapshot(f"{GPU0},{GPU1}"), blind) is not None
    assert why_unknown(marked_snapshot(None), blind) is not None, "devices unknown: any blind spot"
    assert why_unknown(marked_snapshot(MIG, status="False"), blind) is None, "not in use stays so"


def test_no_gpu_library_means_nothing_is_known() -> None:
    spec = GpuNodeUsageSpec(
        node_name="n1",
        observed_at=NOW,
        source=Source(kind="nvml", available=False, message="NVML unavailable (DriverNotLoaded)"),
    )
    cause = why_unknown(marked_snapshot(GPU0), blind_spots(spec, []))
    assert cause is not None
    assert "DriverNotLoaded" not in cause.message, "the agent's words stay in the report"
    assert "cannot read its GPUs" in cause.message


def test_a_device_no_longer_reported_is_not_an_ending() -> None:
    spec = SPEC.model_copy(update={"gpus": [SPEC.gpus[0]]})
    blind = blind_spots(spec, resolve_all(spec, NOBODY))
    assert not blind, "nothing to say about idleness"
    cause = why_unknown(marked_snapshot(GPU1), blind)
    assert cause is not None
    assert "no longer reported" in cause.message


def test_an_unattributable_process_hides_whose_it_is() -> None:
    mystery = Process(pid=99, used_memory_mib=5, resolve_error="cannot read /proc/99/cgroup")
    gpu0 = SPEC.gpus[0].model_copy(update={"processes": [mystery]})
    spec = SPEC.model_copy(update={"gpus": [gpu0, SPEC.gpus[1]]})
    blind = blind_spots(spec, resolve_all(spec, NOBODY))
    cause = why_unknown(marked_snapshot(GPU0), blind)
    assert cause is not None
    assert cause.reason == REASON_UNRESOLVED
    assert "process 99" in cause.message
    assert "cannot read /proc/99/cgroup" not in cause.message, "the agent's words stay"
    assert "status.unattributed says why" in cause.message
    assert why_unknown(marked_snapshot(MIG), blind) is None
    # A host process or a process of a known container says nothing of the kind.
    known = Process(pid=98, container_id=CTR_TRAIN, pod_uid=POD_TRAIN)
    gpu0 = SPEC.gpus[0].model_copy(update={"processes": [known, Process(pid=97)]})
    spec = SPEC.model_copy(update={"gpus": [gpu0, SPEC.gpus[1]]})
    assert not blind_spots(spec, resolve_all(spec, NOBODY))


def test_unknown_reads_well_and_use_seen_again_is_no_new_start() -> None:
    cause = why_unknown(
        marked_snapshot(None),
        blind_spots(
            GpuNodeUsageSpec(
                node_name="n1", observed_at=NOW, source=Source(kind="nvml", available=False)
            ),
            [],
        ),
    )
    unknown = desired_condition("Unknown", None, "n1", unknown=cause)
    assert (unknown["status"], unknown["reason"]) == ("Unknown", REASON_DEVICE)
    assert unknown["message"].endswith("last known use is kept in the annotations")
    running = {
        "type": names.POD_CONDITION_GPU_IN_USE,
        "status": "True",
        "reason": "ProcessesRunning",
    }
    assert event_for(unknown, running) is None
    ended = {**running, "status": "False", "reason": "ProcessesEnded"}
    assert event_for(unknown, ended) is not None
