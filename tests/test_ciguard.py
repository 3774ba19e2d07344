"""tests/ciguard: CI fails when the real node's tests were skipped, and only then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("ci", "body", "code"),
    [
        ("true", "pytest.skip('no node here')", 1),
        ("", "pytest.skip('no node here')", 0),
        ("true", "assert True", 0),
    ],
    ids=["ci-skipped", "local-skipped", "ci-ran"],
)
def test_ci_fails_when_the_node_tests_were_skipped(
    tmp_path: Path, ci: str, body: str, code: int
) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    node: the real node\n")
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n\n@pytest.mark.node\ndef test_on_the_node():\n    " + body + "\n\n\n"
        "def test_elsewhere():\n    assert True\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    env["PYTHONPATH"] = str(REPO)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.ciguard", "-p", "no:cacheprovider",
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ran.returncode == code, ran.stdout[-1500:]
    if code:
        assert "test(s) of the real node were skipped" in ran.stdout
