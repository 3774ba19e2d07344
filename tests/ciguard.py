"""CI fails when the node's tests were skipped: a run that proved nothing about the real node
must not pass for one that did. Outside CI (`CI` unset or not `true`) a skip stays a skip, said
with its reason, as on a machine that cannot run a node."""

from __future__ import annotations

import os

import pytest

_skipped: list[str] = []
NODE = ("gpuusage_node_test", "1")
"""Put on the reports of tests that carry the `node` marker (xdist passes it to the
controller with the report)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> object:
    outcome = yield
    if item.get_closest_marker("node") is not None:
        outcome.get_result().user_properties.append(NODE)  # type: ignore[attr-defined]
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every report reaches the controller, also from xdist's workers; an expected failure
    (xfail) is no skip."""
    skipped = report.skipped and not hasattr(report, "wasxfail")
    if skipped and NODE in [tuple(p) for p in report.user_properties]:
        _skipped.append(report.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or os.environ.get("CI") != "true" or not _skipped:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"CI=true: {len(_skipped)} test(s) of the real node were skipped (first: "
            f"{_skipped[0]}); CI must run them",
            red=True,
        )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
