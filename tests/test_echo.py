"""What the reconciler remembers of a report: the echo of its own status write (the watch event
that only echoes it is skipped, and nothing else), and the pods its status lists.

The status API is answered in-process, as the apiserver would (the written object with a new
resourceVersion): what is tested is the reconciler's bookkeeping, not the transport. The
on-cluster end-to-end test checks the running operator's skip counter.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from kubernetes import client

from gpuusage_operator.controller.debounce import WriteBudget
from gpuusage_operator.controller.reconcile import DUE, Reconciler
from gpuusage_operator.index.pods import PodLookup
from tests.builders import api_pod, apply_merge_patch, pod_lookup
from tests.examples import CTR_TRAIN, POD_TRAIN, example_spec

NOW = datetime(2026, 11, 21, 12, 0, 30, tzinfo=UTC)
NODE = "gpu-node-a"


class StatusApi:
    """patch_cluster_custom_object_status as the apiserver answers it: a merge patch applied
    to the stored status, refused with 409 when it names a resourceVersion not current."""

    def __init__(self) -> None:
        self.version = 100
        self.writes = 0
        self.refused = 0
        self.bodies: list[dict[str, Any]] = []
        self.status: dict[str, Any] | None = None
        self.generation = 1

    def patch_cluster_custom_object_status(
        self, group: str, version: str, plural: str, name: str, body: dict[str, Any], **_: Any
    ) -> Any:
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != str(self.version):
            self.refused += 1
            raise client.ApiException(status=409, reason="Conflict")
        self.version += 1
        self.writes += 1
        self.bodies.append(body)
        self.status = apply_merge_patch(self.status, body["status"])
        meta = {"name": name, "resourceVersion": str(self.version), "generation": self.generation}
        answer = {"metadata": meta, "status": self.status}
        return SimpleNamespace(data=json.dumps(answer).encode(), release_conn=lambda: None)


def _report(version: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": NODE, "resourceVersion": version, "generation": 1},
        "spec": example_spec(NODE, NOW).to_api(),
    }
    if status is not None:
        body["status"] = status
    return body


def _event(version: str, name: str = NODE) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version}}


def test_only_the_echo_of_our_own_status_write_is_skipped() -> None:
    api = StatusApi()
    reconciler = Reconciler(client.ApiClient(), reports_api=api)
    nobody = PodLookup({})  # no pods: every process is unattributed, no pod writes

    reconciler.reconcile(_report("7"), nobody, NOW)
    assert api.writes == 1
    assert reconciler.is_echo(_event("101")), "the version our write produced"
    assert not reconciler.is_echo(_event("7")), "the report as the agent wrote it"
    assert not reconciler.is_echo(_event("102")), "anyone's later write"
    assert not reconciler.is_echo(_event("101", name="gpu-node-b")), "another report"
    assert not reconciler.is_echo({"metadata": {"name": NODE}})

    # Reconciling the echo anyway (as the staleness watch does, for a later time) finds the
    # status right, writes nothing, and forgets the echo: only a version that this replica's
    # last write produced counts.
    reconciler.reconcile(_report("101", api.status), nobody, NOW)
    assert api.writes == 1
    assert not reconciler.is_echo(_event("101"))

    # The agent wrote a new spec between our read and our write: the version our write
    # produced shows a newer generation than we reconciled, so its event must be reconciled.
    api.generation = 2
    reconciler.reconcile(_report("8", api.status), nobody, datetime(2026, 11, 21, 13, tzinfo=UTC))
    assert api.writes == 2
    assert not reconciler.is_echo(_event(str(api.version)))
    api.generation = 1

    # The next change is written, and its echo known; a deleted report leaves nothing behind.
    reconciler.reconcile(_report("9"), nobody, NOW)
    assert api.writes == 3
    assert reconciler.is_echo(_event("103"))
    reconciler.forget_node(NODE, nobody, NOW)
    assert not reconciler.is_echo(_event("103"))


def test_deleting_a_pod_the_status_lists_makes_the_report_due() -> None:
    """A pod's deletion sends no report event (the agent may send nothing for a while): the
    report whose status lists the pod is due at once, and no report for another pod."""
    api = StatusApi()
    no_pod_writes = WriteBudget(0.001, 0)  # the pods' marks wait: only the status is written
    reconciler = Reconciler(client.ApiClient(), reports_api=api, write_budget=no_pod_writes)
    reconciler.reconcile(_report("7"), pod_lookup(api_pod("t", POD_TRAIN, {"c": CTR_TRAIN})), NOW)
    assert api.writes == 1
    while (taken := reconciler.queue.get(timeout=0)) is not None:  # the waiting marks' due
        reconciler.queue.done(taken[0])
    reconciler.pods_deleted({"00000000-0000-4000-8000-000000000000"})
    assert reconciler.queue.get(timeout=0) is None
    reconciler.pods_deleted({POD_TRAIN})
    assert reconciler.queue.get(timeout=0) == (NODE, frozenset({DUE}))
