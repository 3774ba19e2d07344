"""The compatibility run's reading of each release's results."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuusage_dev.compat import Outcome, counts, main


def test_counts_read_errors_as_failures(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="10" failures="1" '
        'errors="2" skipped="3"></testsuite></testsuites>'
    )
    assert counts(junit) == (4, 3, 3)
    junit.write_text('<testsuite name="pytest" tests="5" failures="0" errors="0" skipped="0"/>')
    assert counts(junit) == (5, 0, 0)


def test_a_row_says_each_count_and_the_time() -> None:
    assert Outcome("v1.35.4", 70, 0, 6, 212.4).row == "| v1.35.4 | 70 | 0 | 6 | 212 s |"


def test_unknown_options_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--newest"])
