"""The scenario-file GPU source: edits followed, bad files refused with the last good kept,
injected NVML errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage_nodeagent.gpusource.base import RawProcess, Reading
from gpuusage_nodeagent.gpusource.fake import FakeSource, ScenarioError
from tests.builders import one_process_scenario
from tests.fakenvml import gpu_uuid


def _first_process(reading: Reading) -> RawProcess:
    return reading.processes_of(reading.gpus[0])[0]


def test_fake_source_follows_edits_and_keeps_the_last_good_scenario(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    one_process_scenario(path, 100)
    source = FakeSource(path)
    assert _first_process(source.read()).used_memory_mib == 100
    one_process_scenario(path, 300)
    assert _first_process(source.read()).used_memory_mib == 300
    path.write_text("gpus: [ {index: 0, uuid: nope")  # a half-saved edit
    reading = source.read()
    assert _first_process(reading).used_memory_mib == 300
    assert reading.source.message is not None
    assert "not valid YAML" in reading.source.message
    assert reading.errors["ScenarioInvalid"] == 1


def test_fake_source_rejects_a_bad_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"gpus": [{"index": 0, "uuid": gpu_uuid(0)}]}))
    with pytest.raises(ScenarioError, match=r"gpus\.0\.memoryTotalMiB: Field required"):
        FakeSource(path)
    with pytest.raises(ScenarioError, match="cannot read GPU scenario"):
        FakeSource(tmp_path / "missing.yaml")


def test_fake_source_injects_nvml_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "gpus": [
                    {"index": 0, "uuid": gpu_uuid(0), "memoryTotalMiB": 10, "error": "GpuIsLost"},
                    {
                        "index": 1,
                        "uuid": gpu_uuid(1),
                        "memoryTotalMiB": 10,
                        "processesError": "NoPermission",
                        "processes": [{"pid": 9}],
                    },
                    {
                        "index": 2,
                        "uuid": gpu_uuid(2),
                        "memoryTotalMiB": 10,
                        "processes": [{"pid": 8}],
                    },
                ]
            }
        )
    )
    reading = FakeSource(path).read()
    gpus = reading.gpus
    assert gpus[0].error is not None
    assert gpus[0].error.reason == "GpuIsLost"
    assert gpus[1].error is not None
    assert gpus[1].error.reason == "NoPermission"
    assert reading.processes_of(gpus[1]) == ()
    assert [p.pid for p in reading.processes_of(gpus[2])] == [8]
    path.write_text(yaml.safe_dump({"nvmlError": "DriverNotLoaded"}))
    reading = FakeSource(path).read()
    assert reading.source.available is False
    assert reading.gpus == []


def _gpu(index: int, **fields: Any) -> dict[str, Any]:
    return {"index": index, "uuid": gpu_uuid(index), "memoryTotalMiB": 9, **fields}


def _gpus(*gpus: dict[str, Any]) -> bytes:
    return yaml.safe_dump({"gpus": list(gpus)}).encode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"gpus:\n  - name: caf\xe9\n", "is not UTF-8 text (byte 19"),
        (b"", "is empty; a node without GPUs is written `gpus: []`"),
        (b"# nothing but a comment\n", "is empty"),
        (b"- a list\n", "must be a mapping with `gpus:`, not list"),
        (_gpus(_gpu(0, name="x" * 97)), "gpus.0.name: String should have at most 96 characters"),
        (yaml.safe_dump({"driverVersion": "5" * 65}).encode(), "driverVersion: String should"),
        (_gpus(_gpu(0, processes=[{"pid": 7}, {"pid": 7}])), "listed more than once: 7"),
        (_gpus(_gpu(0), _gpu(1, uuid=gpu_uuid(0))), "device UUID listed more than once: GPU-"),
        (_gpus(_gpu(0), _gpu(0, uuid=gpu_uuid(1))), "GPU index listed more than once: 0"),
    ],
)
def test_every_invalid_scenario_is_refused_with_a_message_and_the_last_valid_one_kept(
    tmp_path: Path, content: bytes, message: str
) -> None:
    """At start: a clear error. While running: the last valid scenario, and the reason said in
    the published source, so a bad edit never ends a pod's use or counts a process twice."""
    path = tmp_path / "s.yaml"
    path.write_bytes(content)
    with pytest.raises(ScenarioError, match=re.escape(message)):
        FakeSource(path)
    one_process_scenario(path, 100)
    source = FakeSource(path)
    path.write_bytes(content)
    reading = source.read()
    assert _first_process(reading).used_memory_mib == 100, "the last valid scenario is kept"
    assert reading.source.message is not None
    assert message in reading.source.message
    assert reading.source.message.endswith("showing the last valid scenario")
    assert reading.errors["ScenarioInvalid"] == 1
