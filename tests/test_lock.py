"""Each image installs exactly its lock: every package pinned with its wheels' sha256, each pin
inside what the requirements allow, and nothing the requirements pull in left out."""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gpuusage_dev.lock import PARTS, lock_path, requirement_files

PIN = re.compile(r"^([A-Za-z0-9][\w.-]*)==(\S+) \\$")


def _pins(part: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes), read as pip reads the lock (continuation lines joined)."""
    found: dict[str, tuple[str, list[str]]] = {}
    text = lock_path(part).read_text().replace("\\\n", "\\\x00")
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, *rest = line.split("\x00")
        matched = PIN.match(head)
        assert matched, f"{part}: not a pinned line: {head}"
        hashes = [h.strip().removesuffix("\\").strip() for h in rest]
        assert hashes, f"{part}: {matched[1]} has no hash"
        assert all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), hashes
        found[canonicalize_name(matched[1])] = (matched[2], hashes)
    return found


@pytest.mark.parametrize("part", PARTS)
def test_every_requirement_is_pinned_within_its_range(part: str) -> None:
    pins = _pins(part)
    for file in requirement_files(part):
        for line in file.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                wanted = Requirement(line)
                version, _ = pins[canonicalize_name(wanted.name)]
                assert wanted.specifier.contains(version), f"{part}: {wanted} but {version}"


def test_the_agents_lock_holds_no_kubernetes_client() -> None:
    assert not {"kubernetes", "kopf"} & set(_pins("nodeagent"))
    assert {"kubernetes", "kopf"} <= set(_pins("operator"))


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_the_lock_installs_with_hashes_required_and_is_complete(part: str, tmp_path: Path) -> None:
    """pip in hash-checking mode refuses a lock that misses a dependency or whose hash does not
    match the downloaded wheel; installed with its dependencies resolved, nothing is added."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    run = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--require-hashes", "-r", str(lock_path(part))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze", "--exclude", "pip"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {canonicalize_name(n): v for n, v in (x.split("==") for x in listed.split())}
    installed.pop(canonicalize_name("setuptools"), None)
    assert installed == {name: v for name, (v, _) in _pins(part).items()}


def test_a_lock_missing_a_dependency_is_refused(tmp_path: Path) -> None:
    """What the completeness check rests on: pip refuses, in hash-checking mode, a dependency
    the lock does not pin (here h2's hpack and hyperframe)."""
    version, hashes = _pins("nodeagent")["h2"]
    partial = tmp_path / "partial.lock"
    partial.write_text(f"h2=={version} " + " ".join(hashes) + "\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--target",
            str(tmp_path / "t"),
            "--require-hashes",
            "-r",
            str(partial),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode != 0
    assert "hpack" in run.stderr or "hyperframe" in run.stderr, run.stderr
