"""`gpuusage demo` (what `make demo` runs): it says which node it runs on, and shows the
findings it promises, on the simulated node and, where this machine can run one, on a real
node."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuusage_dev.commands import DemoSettings, run_demo
from gpuusage_dev.localcluster.node import cannot_run_node

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FINDINGS = ("UsingUnrequestedGPU", "UsingUnallocatedGPU", "HoldingIdleGPU", "GPUUseEnded")
REPORTS = (  # the findings as OpenReports, pods' per namespace and the nodes'
    "ml-team/train-1\tUsingUnallocatedGPU\tfail/high",
    "research/notebook\tUsingUnrequestedGPU\tfail/high",
    "research/lab\tHoldingIdleGPU\twarn/medium",
)
POLICIES = (  # announced, recorded as a dry run, enforced; the policies' table
    "GPUPolicyPending",
    "GPUPolicyDryRun",
    "GPUPolicyActed",
    "reclaim-idle   DryRun",
    "stop-misuse    Enforce",
    "research/lab: Running, left alone",
    "(Enforce); this policy ignores a pod's own gpuusage.io/exempt",  # the misuse policy's
)


def test_the_simulated_demo(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run_demo(DemoSettings(dir=tmp_path / "demo", simulated=True)) == 0
    shown = capfd.readouterr().out
    assert shown.startswith("gpuusage demo: on a simulated node (no real node here: --simulated)")
    for finding in FINDINGS + REPORTS + POLICIES:
        assert finding in shown, finding
    assert "node/gpu-node-a\tOrphanedGPUMemory\twarn/medium" in shown  # its host process


@pytest.mark.node
def test_the_demo_on_a_real_node(
    tmp_path_factory: pytest.TempPathFactory, capfd: pytest.CaptureFixture[str]
) -> None:
    why = cannot_run_node(product=True)
    if why is not None:
        pytest.skip(f"this machine cannot run a node: {why}")
    # A short folder: the node's sockets live in it (sockets_too_long).
    assert run_demo(DemoSettings(dir=tmp_path_factory.mktemp("demo"))) == 0
    shown = capfd.readouterr().out
    assert shown.startswith("gpuusage demo: on a real node")
    for finding in FINDINGS + REPORTS + POLICIES:
        assert finding in shown, finding
    assert "kubelet gave it GPU-" in shown
