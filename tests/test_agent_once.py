"""`gpuusage agent --once --output json` over a varied corpus: every process attributed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage.api.models import GpuNodeUsage
from gpuusage_dev.proctree import write_process
from tests.conftest import CHILD_ENV
from tests.fakenvml import gpu_uuid, mig_uuid

pytestmark = pytest.mark.slow  # each runs the agent's command line

CORPUS: list[dict[str, Any]] = yaml.safe_load(
    (Path(__file__).parent / "data" / "cgroup_corpus.yaml").read_text()
)


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuusage.cli", "agent", *args],
        capture_output=True,
        text=True,
        check=False,
        env=CHILD_ENV,
        timeout=60,
    )


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    """A proc tree with one process per corpus layout, spread over 4 GPUs and a MIG slice."""
    proc = tmp_path / "proc"
    gpus: list[dict[str, Any]] = [
        {
            "index": i,
            "uuid": gpu_uuid(i),
            "name": "NVIDIA A100-SXM4-80GB",
            "memoryTotalMiB": 81920,
            "processes": [],
        }
        for i in range(4)
    ]
    gpus[3]["migDevices"] = [
        {"index": 0, "uuid": mig_uuid(0), "memoryTotalMiB": 40192, "processes": []}
    ]
    for n, case in enumerate(CORPUS):
        pid = 1000 + n
        write_process(proc, pid, case["cgroup"], comm=f"worker-{n}")
        entry = {"pid": pid, "usedMemoryMiB": 100 + n}
        if n % 4 == 3:
            gpus[3]["migDevices"][0]["processes"].append(entry)
        else:
            gpus[n % 4]["processes"].append(entry)
    # A pid NVML reports but the proc root does not have (exited, or wrong PID namespace).
    gpus[0]["processes"].append({"pid": 99999, "usedMemoryMiB": 5})
    # A process whose cgroup file cannot be read.
    broken = write_process(proc, 2000, "0::/", comm="broken")
    (broken / "cgroup").unlink()
    (broken / "cgroup").mkdir()
    gpus[1]["processes"].append({"pid": 2000, "usedMemoryMiB": 7})
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"driverVersion": "550.54.15", "gpus": gpus}))
    return scenario, proc


def test_once_json_attributes_every_process_of_the_corpus(node: tuple[Path, Path]) -> None:
    scenario, proc = node
    result = _agent(
        "--once",
        "--output",
        "json",
        "--node-name",
        "gpu-7",
        "--gpu-source",
        f"fake:{scenario}",
        "--proc-root",
        str(proc),
    )
    assert result.returncode == 0, result.stderr
    obj = GpuNodeUsage.model_validate(json.loads(result.stdout))
    assert obj.metadata.name == "gpu-7"
    assert obj.spec.node_name == "gpu-7"
    listed = {p.pid: p for g in obj.spec.gpus for p in g.processes}
    listed |= {p.pid: p for g in obj.spec.gpus for m in g.mig_devices for p in m.processes}
    for n, case in enumerate(CORPUS):
        process = listed[1000 + n]
        assert (process.container_id, process.pod_uid) == (case["container"], case["pod"]), case[
            "name"
        ]
        assert process.name == f"worker-{n}"
        assert process.resolve_error is None
    gone = listed[99999]
    assert gone.container_id is None
    assert gone.resolve_error is not None
    assert "not found under" in gone.resolve_error
    unreadable = listed[2000]
    assert unreadable.resolve_error is not None
    assert "cannot read" in unreadable.resolve_error
    assert "s3cr3t" not in result.stdout, "command lines are never published"


def test_once_json_touches_no_api(node: tuple[Path, Path], tmp_path: Path) -> None:
    scenario, proc = node
    bogus = tmp_path / "kubeconfig"
    bogus.write_text("this is not a kubeconfig")
    args = ["--once", "--output", "json", "--node-name", "n1", "--kubeconfig", str(bogus)]
    result = _agent(*args, "--gpu-source", f"fake:{scenario}", "--proc-root", str(proc))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "GpuNodeUsage"


def test_output_json_needs_once() -> None:
    result = _agent("--output", "json", "--node-name", "n1", "--gpu-source", "none")
    assert result.returncode == 2
    assert "--output json needs --once" in result.stderr


def test_node_name_from_downward_api_variable(tmp_path: Path) -> None:
    env = {**CHILD_ENV, "NODE_NAME": "from-downward-api"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuusage.cli",
            "agent",
            "--once",
            "--output",
            "json",
            "--gpu-source",
            "none",
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["spec"]
    assert spec["nodeName"] == "from-downward-api"
    assert spec["source"] == {**spec["source"], "kind": "none", "available": False}
    assert spec["gpus"] == []


LONG_NAME = f"gpus: [{{index: 0, uuid: {gpu_uuid(0)}, memoryTotalMiB: 1, name: {'n' * 300}}}]"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"gpus:\n  - index: 0\n    uuid: GPU-nope\n    memoryTotalMiB: 10\n", "gpus.0.uuid"),
        (b"driverVersion: caf\xe9\n", "is not UTF-8 text"),
        (b"", "is empty"),
        (LONG_NAME.encode(), "gpus.0.name"),
        (f"driverVersion: '{'9' * 70}'".encode(), "driverVersion"),
    ],
)
def test_invalid_scenario_is_a_clear_error(tmp_path: Path, content: bytes, said: str) -> None:
    """At start, every invalid scenario ends the agent with exit code 2 and a message."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    for mode in (["--output", "json"], []):
        result = _agent(
            "--once",
            *mode,
            "--node-name",
            "n1",
            "--gpu-source",
            f"fake:{bad}",
            "--kubeconfig",
            str(tmp_path / "none"),
        )
        assert result.returncode == 2
        assert said in result.stderr
        assert "Traceback" not in result.stderr
