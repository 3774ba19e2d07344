"""The hosted workflows: actionlint finds nothing in them, CI runs exactly `.ci/run` (nothing
weaker: no step skipped, no failure let through, no test left out), and a tag runs
`make release` and publishes what it built."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage_dev.localcluster.binaries import MIN_GO
from gpuusage_dev.version import project
from gpuusage_dev.workflows import FOLDER, actionlint, workflow_files

REPO = Path(__file__).resolve().parents[1]
CI = FOLDER / "ci.yml"
RELEASE = FOLDER / "release.yml"
ACTIONS = ("actions/checkout", "actions/setup-go", "actions/setup-python")
"""The only actions the workflows may call; everything else is the project's own make."""
PINNED = re.compile(r"^\s*(?:-\s+)?uses:\s+(\S+)@([0-9a-f]{40}) # v\d+\.\d+\.\d+$")


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[Any, Any] = yaml.safe_load((REPO / path).read_text())
    # YAML 1.1 reads the key `on` as true
    return {"on" if key is True else str(key): value for key, value in loaded.items()}


def _steps(data: dict[str, Any]) -> list[dict[str, Any]]:
    (job,) = data["jobs"].values()
    steps: list[dict[str, Any]] = job["steps"]
    return steps


@pytest.mark.slow  # builds actionlint from its Go module on first use
def test_actionlint_finds_nothing() -> None:
    assert workflow_files(REPO) == [CI, RELEASE]
    verdict = actionlint([CI, RELEASE], REPO)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr


@pytest.mark.slow
def test_actionlint_can_fail(tmp_path: Path) -> None:
    broken = tmp_path / FOLDER / "ci.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(
        (REPO / CI)
        .read_text()
        .replace("runs-on: ubuntu-24.04", "runs-on: ubuntu-24.04\n    if: ${{ github.no_such }}")
    )
    verdict = actionlint([FOLDER / "ci.yml"], tmp_path)
    assert verdict.returncode != 0
    assert "no_such" in verdict.stdout


def test_ci_runs_exactly_the_ci_script_on_every_push_and_pull_request() -> None:
    data = _load(CI)
    assert set(data["on"]) == {"push", "pull_request"}
    assert not any(data["on"].values()), "no branch or path filter: every push and PR"
    (job,) = data["jobs"].values()
    assert job["runs-on"].startswith("ubuntu-")
    weaker = {"if", "continue-on-error", "env"}
    assert not weaker & set(job), job
    assert "env" not in data, "nothing set that changes what the suite runs"
    scripts = [step for step in _steps(data) if "run" in step]
    assert len(scripts) == 1, "one command: .ci/run"
    (step,) = scripts
    assert not weaker & set(step), step
    words = shlex.split(step["run"])
    assert words == ["sudo", "-E", "env", "PATH=$PATH", "bash", ".ci/run"]
    ci_script = (REPO / ".ci/run").read_text().splitlines()
    assert "set -euo pipefail" in ci_script
    # the README's test command, nothing weaker, and the oldest supported Kubernetes after it
    assert [line for line in ci_script if line.startswith("make")] == [
        "make lint",
        "make test",
        "make test-oldest",
    ]


def test_ci_sets_up_the_go_and_python_the_project_needs() -> None:
    data = _load(CI)
    used = {
        step["uses"].split("@")[0]: step.get("with", {}) for step in _steps(data) if "uses" in step
    }
    go = tuple(int(n) for n in str(used["actions/setup-go"]["go-version"]).split("."))
    assert go >= MIN_GO
    # Kubernetes' newest supported release, which the local cluster builds by default, asks 1.26
    assert go >= (1, 26)
    floor = str(project(REPO)["requires-python"]).removeprefix(">=")
    assert str(used["actions/setup-python"]["python-version"]) == floor


def test_a_tag_runs_make_release_and_publishes_dist() -> None:
    data = _load(RELEASE)
    assert data["on"] == {"push": {"tags": ["v*"]}}
    (job,) = data["jobs"].values()
    assert job["permissions"] == {
        "contents": "write",
        "packages": "write",
        "id-token": "write",
    }
    assert data["permissions"] == {"contents": "read"}
    scripts = "\n".join(step["run"] for step in _steps(data) if "run" in step)
    assert re.search(
        r'make release VERSION="\$\{TAG#v\}" REGISTRY="ghcr\.io/\$\{OWNER,,\}" KEYLESS=1', scripts
    )
    assert 'gh release create "$TAG" --verify-tag' in scripts
    assert "gpuusage-*.tgz gpuusage.krew.yaml" in scripts
    assert "kubectl-gpuusage-*.tar.gz SHA256SUMS" in scripts
    assert "sha256sum --check --strict SHA256SUMS" in scripts
    envs = [step.get("env", {}) for step in _steps(data)]
    assert {"TAG": "${{ github.ref_name }}"}.items() <= envs[-1].items()


@pytest.mark.parametrize("workflow", [CI, RELEASE], ids=str)
def test_only_the_setup_actions_pinned_by_commit(workflow: Path) -> None:
    """A tag can be moved; a commit cannot. The comment says which release it is."""
    lines = [line for line in (REPO / workflow).read_text().splitlines() if "uses:" in line]
    assert lines
    for line in lines:
        pinned = PINNED.match(line)
        assert pinned is not None, f"{workflow}: {line.strip()}: not pinned by commit"
        assert pinned[1] in ACTIONS, f"{workflow}: {pinned[1]} is not one of {ACTIONS}"
    for step in _steps(_load(workflow)):
        if step.get("uses", "").startswith("actions/checkout@"):
            assert step["with"]["persist-credentials"] is False


def test_make_release_passes_the_registry_and_keyless_signing_on() -> None:
    """What the release workflow sets reaches the release's command line (make -n: printed,
    not run)."""

    def planned(*variables: str) -> str:
        return subprocess.run(
            ["make", "-n", "release", "VERSION=0.1.0", *variables],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    keyless = planned("REGISTRY=ghcr.io/team", "KEYLESS=1")
    assert '--registry "ghcr.io/team" --keyless' in keyless
    assert "--keyless" not in planned("KEYLESS=0")
    plain = planned()
    assert "gpuusage_dev.release --out dist" in plain
    assert "--registry" not in plain
    assert "--keyless" not in plain
