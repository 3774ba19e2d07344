"""The agent says what its own setup keeps it from seeing: outside the host's pid namespace,
or without the NVIDIA runtime's driver library in its container."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.main import NodeReader
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.selfcheck import Setup, gather, nvml_note, pid_namespace_note
from tests.fakenvml import FakeGpu, FakeMachine, FakeProcess, gpu_uuid


def test_the_agent_knows_whether_it_shares_the_proc_roots_pid_namespace(tmp_path: Path) -> None:
    """procfs names the reader's own pid as `self` in the namespace its mount belongs to: the
    machine's /proc here is this process's; a host /proc seen from a container without hostPID
    names another number; a tree with no `self` cannot tell."""
    assert gather(Path("/proc")).own_pid_namespace is True
    other = tmp_path / "host-proc"
    other.mkdir()
    (other / "self").symlink_to(str(os.getpid() + 1))
    assert gather(other).own_pid_namespace is False
    assert gather(tmp_path).own_pid_namespace is None
    note = pid_namespace_note(gather(other))
    assert note is not None
    assert "hostPID" in note
    assert pid_namespace_note(gather(Path("/proc"))) is None


def test_outside_the_pid_namespace_the_report_says_why_processes_are_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The open kernel modules drop pids of other namespaces: the device is blind and the
    report's source says that the agent lacks hostPID."""
    gpu = FakeGpu(uuid=gpu_uuid(0), reserved_mib=500, processes=[FakeProcess(9, listed=False)])
    FakeMachine([gpu]).install(monkeypatch)
    setup = Setup(proc_root=Path("/host/proc"), own_pid_namespace=False, device_nodes=True)
    reader = NodeReader("n1", NvmlSource(pynvml), Resolver(tmp_path), setup=setup)
    spec = reader.read().spec()
    assert spec.source is not None
    assert spec.source.message is not None
    assert "not in the pid namespace of /host/proc" in spec.source.message
    assert spec.gpus[0].error is not None
    assert spec.gpus[0].error.reason == "ProcessesNotVisible"


@pytest.mark.parametrize(
    ("setup", "code", "says"),
    [
        (
            Setup(Path("/proc")),
            pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
            "NVIDIA_VISIBLE_DEVICES is not set",
        ),
        (
            Setup(Path("/proc"), visible_devices="all"),
            pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
            "runtimeClassName nvidia",
        ),
        (
            Setup(Path("/proc"), device_nodes=True, visible_devices="all"),
            pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
            "not the driver library",
        ),
        (
            Setup(Path("/proc"), device_nodes=True, visible_devices="all"),
            pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
            "kernel driver is not loaded",
        ),
    ],
    ids=["no runtime variable", "runtime did not run", "CDI without libraries", "no driver"],
)
def test_an_unreachable_nvml_is_explained_in_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setup: Setup, code: int, says: str
) -> None:
    FakeMachine([], init_error=code).install(monkeypatch)
    reader = NodeReader("n1", NvmlSource(pynvml), Resolver(tmp_path), setup=setup)
    source = reader.read().spec().source
    assert source is not None
    assert source.available is False
    assert source.message is not None
    assert "NVML unavailable" in source.message
    assert says in source.message


def test_nothing_is_said_when_nvml_answers() -> None:
    assert nvml_note(Setup(Path("/proc")), {}) is None
