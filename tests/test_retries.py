"""A reconcile that fails is tried again, with a backoff, until it succeeds: with Leases an
unchanged report is rewritten only every few minutes, so waiting for its next event could
leave a status (and the pods' marks) that old."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tests.conftest import WorldFactory, wait_for
from tests.worldview import condition, pod, refreshed_rarely, refusing, report


def _failures(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(v)
        for v in re.findall(
            r"^gpuusage_operator_reconcile_failures_total\{[^}]*\} (\S+)$", text, re.M
        )
    )


@pytest.mark.cluster
def test_a_failed_status_write_is_tried_again_without_a_new_report(
    make_world: WorldFactory,
) -> None:
    world = make_world({"train": 1, "notebook": 1}, leases=True, agent_lease=True, stale_after=60)
    wait_for(lambda: condition(pod(world, "notebook")).status == "True", what="marked")
    refreshed_rarely(world)  # from here on the agent writes the report only when it changes
    with refusing(
        world.api,
        f"refuse-status-{world.node}",
        world.node,
        "gpunodeusages/status",
        ["UPDATE"],
    ):
        # Policies are compiled asynchronously: change the node until a status write fails.
        before, notebook = _failures(world.metrics_port), True
        deadline = time.monotonic() + 30
        while _failures(world.metrics_port) == before:
            assert time.monotonic() < deadline, "no status write was refused"
            notebook = not notebook
            world.write(notebook=notebook)
            time.sleep(1.0)
    generation = report(world)["metadata"]["generation"]
    # The agent refreshes an unchanged report only after 60 s: the retry alone gets here.
    wait_for(
        lambda: report(world).get("status", {}).get("observedGeneration") == generation,
        timeout=20,
        what="the status written by a retry",
    )
    wanted = "True" if notebook else "False"
    wait_for(
        lambda: condition(pod(world, "notebook")).status == wanted,
        timeout=10,
        what="the pod's marks as the node shows",
    )
    assert report(world)["metadata"]["generation"] == generation, "no new report came"
