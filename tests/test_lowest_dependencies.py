"""The requirements' floors are tested, not hoped for: the lowest version of each dependency
they admit is installed in a virtualenv of its own, and the tests that touch each library's
surface (NVML's bindings, pydantic's schemas, the Kubernetes client's calls, kopf, h2) run
there against the real control plane.

The virtualenv is cached (by the pins' content) under the project's cache folder, so only the
first run downloads.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from gpuusage_dev.localcluster.binaries import cache_root

REPO = Path(__file__).resolve().parents[1]
PINS = REPO / "tests" / "data" / "lowest-requirements.txt"
REQUIREMENTS = [REPO / part / "requirements.txt" for part in ("src", "nodeagent", "operator")]
SURFACE = [
    "tests/test_nvml_source.py",
    "tests/test_visibility.py",
    "tests/test_driver_processes.py",
    "tests/test_selfcheck.py",
    "tests/test_models_and_crd.py",
    "tests/test_podresources.py",
    "tests/test_operator_core.py",
    "tests/test_real_drivers_on_cluster.py",
    "tests/test_allocation_on_cluster.py",
    "tests/test_dra_versions_on_cluster.py",
    "tests/test_lease_on_cluster.py",
    "tests/test_kube_core_on_cluster.py",
    # the Event and the Lease written as built (kube.core's EventApi, LeaseApi)
    "tests/test_event_series.py::test_an_event_on_a_whole_second_is_recorded_and_counted_with_its_six_digits",
    "tests/test_operator_ha.py::test_the_lease_lock_round_trips_times_on_a_whole_second",
]
"""Tests that exercise what each dependency offers: NVML structs and calls, pydantic models and
the CRD they render, the client's patch/list/watch calls (kubernetes, kopf), HTTP/2 (h2)."""


def _pins() -> dict[str, str]:
    found = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            found[name.strip().lower()] = version.strip()
    return found


def _floors() -> dict[str, str]:
    found = {}
    for path in REQUIREMENTS:
        for line in path.read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9._-]+)>=([0-9.]+)", line)
            if match:
                found[match[1].lower()] = match[2]
    return found


def _same(pinned: str, floor: str) -> bool:
    """1.45.0 is the floor 1.45; 36.0.0 is 36."""
    return pinned.split(".")[: len(floor.split("."))] == floor.split(".") and all(
        part == "0" for part in pinned.split(".")[len(floor.split(".")) :]
    )


def test_every_floor_is_pinned_at_the_lowest_version() -> None:
    """Each requirement's `>=` floor is the version the lowest-dependencies run installs, and
    every requirement has an upper bound (a range that is tested, not an open promise)."""
    pins, floors = _pins(), _floors()
    assert sorted(pins) == sorted(floors)
    for name, floor in floors.items():
        assert _same(pins[name], floor), f"{name}: pinned {pins[name]}, floor {floor}"
    for path in REQUIREMENTS:
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                assert "<" in line, f"{path.name}: {line} has no upper bound"


def _lowest_venv() -> Path:
    digest = hashlib.sha256(PINS.read_bytes()).hexdigest()[:12]
    home = cache_root() / f"venv-lowest-{digest}"
    python = home / "bin" / "python"
    if (home / ".complete").exists():
        return python
    shutil.rmtree(home, ignore_errors=True)
    venv.create(home, with_pip=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-r", str(PINS), "pytest", "hypothesis"],
        check=True,
    )
    (home / ".complete").touch()
    return python


@pytest.mark.slow
@pytest.mark.cluster
def test_the_lowest_versions_pass_the_tests_that_use_them() -> None:
    python = _lowest_venv()
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.lower()
    for name, version in _pins().items():
        assert f"{name}=={version}" in listed.replace("_", "-"), f"{name} is not {version}"
    run = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SURFACE],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-30:])
    assert run.returncode == 0, tail
    assert re.search(r"\d+ passed", run.stdout), tail
    assert sys.executable != str(python)
