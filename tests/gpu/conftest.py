"""The real-GPU suite: every test is marked `gpu` and skipped, with the reason, where no GPU,
NVML and CUDA driver are found, so `make test` stays green everywhere; `make test-gpu` runs it.
Figures the tests measure go to $GPUUSAGE_GPU_FIGURES (JSON) and the terminal."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.machine import Tenants, cgroup_base, no_gpu_reason

NO_GPU = no_gpu_reason()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if NO_GPU is not None:
                item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture
def tenants() -> Iterator[Tenants]:
    started = Tenants()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def cgroups() -> Path:
    base = cgroup_base()
    if base is None:
        pytest.skip("making cgroups needs root and a writable cgroup tree")
    return base


FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    yield FIGURES
    if FIGURES:
        text = json.dumps(FIGURES, indent=2, sort_keys=True, default=str)
        print(f"\nreal-GPU figures:\n{text}")
        if target := os.environ.get("GPUUSAGE_GPU_FIGURES"):
            Path(target).write_text(text + "\n")
