"""What the reconciler remembers of a report: the echo of its own status write (the watch event
that only echoes it is skipped, and nothing else), the pods its status lists and whether it
says stale (a pod's deletion, a Lease's renewal ask for a reconcile only where they matter).

The status API is answered in-process, as the apiserver would (the written object with a new
resourceVersion): what is tested is the reconciler's bookkeeping, not the transport. The
on-cluster end-to-end test checks the running operator's skip counter.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client

from gpuusage_operator.controller.triggers import RENEWED, STALENESS, Gone
from gpuusage_operator.index.pods import PodLookup
from gpuusage_operator.judge.freshness import DEFAULT_STALE_AFTER, Renewal
from gpuusage_operator.writers.budget import WriteBudget
from tests.builders import ReportStatusApi, api_pod, pod_lookup, reconciler_on
from tests.examples import CTR_TRAIN, POD_TRAIN, example_spec

NOW = datetime(2026, 11, 21, 12, 0, 30, tzinfo=UTC)
NODE = "gpu-node-a"


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
    api = ReportStatusApi()
    reconciler = reconciler_on(client.ApiClient(), reports_api=api)
    book = reconciler.book
    nobody = PodLookup()  # no pods: every process is unattributed, no pod writes

    reconciler.reconcile(_report("7"), nobody, NOW)
    assert api.writes == 1
    assert book.is_echo(_event("101")), "the version our write produced"
    assert not book.is_echo(_event("7")), "the report as the agent wrote it"
    assert not book.is_echo(_event("102")), "anyone's later write"
    assert not book.is_echo(_event("101", name="gpu-node-b")), "another report"
    assert not book.is_echo({"metadata": {"name": NODE}})

    # Reconciling the echo anyway (as the staleness watch does, for a later time) finds the
    # status right, writes nothing, and forgets the echo: only a version that this replica's
    # last write produced counts.
    reconciler.reconcile(_report("101", api.status), nobody, NOW)
    assert api.writes == 1
    assert not book.is_echo(_event("101"))

    # The agent wrote a new spec between our read and our write: the version our write
    # produced shows a newer generation than we reconciled, so its event must be reconciled.
    api.generation = 2
    reconciler.reconcile(_report("8", api.status), nobody, datetime(2026, 11, 21, 13, tzinfo=UTC))
    assert api.writes == 2
    assert not book.is_echo(_event(str(api.version)))
    api.generation = 1

    # The next change is written, and its echo known; a deleted report leaves nothing behind.
    reconciler.reconcile(_report("9"), nobody, NOW)
    assert api.writes == 3
    assert book.is_echo(_event("103"))
    reconciler.forget_node(NODE, nobody, NOW)
    assert not book.is_echo(_event("103"))


def test_deleting_a_pod_the_status_lists_makes_the_report_due() -> None:
    """A pod's deletion sends no report event (the agent may send nothing for a while): the
    watch queues its node's report, which is reconciled when its status lists the pod, and
    not for another pod."""
    api = ReportStatusApi()
    no_pod_writes = WriteBudget(0.001, 0)  # the pods' marks wait: only the status is written
    reconciler = reconciler_on(client.ApiClient(), reports_api=api, write_budget=no_pod_writes)
    reconciler.reconcile(_report("7"), pod_lookup(api_pod("t", POD_TRAIN, {"c": CTR_TRAIN})), NOW)
    assert api.writes == 1
    another = frozenset({Gone("00000000-0000-4000-8000-000000000000")})
    assert not reconciler.needs_reconcile(NODE, another, NOW)
    assert reconciler.needs_reconcile(NODE, frozenset({Gone(POD_TRAIN)}), NOW)
    assert not reconciler.needs_reconcile("gpu-node-b", frozenset({Gone(POD_TRAIN)}), NOW)


def test_a_lease_renewal_matters_only_to_a_report_whose_status_says_stale() -> None:
    """Every agent renews its Lease every 10 s and the watch queues each renewal: one costs a
    reconcile only when it makes a report its status calls stale fresh again."""
    renewal: list[Renewal] = []
    api = ReportStatusApi()
    reconciler = reconciler_on(
        client.ApiClient(), reports_api=api, renewals=lambda node: renewal[-1] if renewal else None
    )
    nobody = PodLookup()
    renewed = frozenset({RENEWED})
    assert not reconciler.reconcile(_report("7"), nobody, NOW), "fresh"
    assert not reconciler.needs_reconcile(NODE, renewed, NOW), "fresh, and says so"
    reconciler.liveness.renewed(NODE)
    assert reconciler.queue.get(timeout=0) is None, "a fresh report's renewal is not queued"
    later = NOW + DEFAULT_STALE_AFTER + timedelta(seconds=1)
    assert reconciler.needs_reconcile(NODE, frozenset({STALENESS}), later), "turned stale"
    assert reconciler.reconcile(_report("101", api.status), nobody, later), "written stale"
    while (taken := reconciler.queue.get(timeout=0)) is not None:  # its own deadlines
        reconciler.queue.done(taken[0])
    reconciler.liveness.renewed(NODE)
    assert reconciler.queue.get(timeout=0) == (NODE, renewed), "a stale report's is"
    assert not reconciler.needs_reconcile(NODE, renewed, later), "no renewal seen yet"
    renewal.append(Renewal(f"gpuusage-system/{NODE}", later, witnessed=True))
    assert reconciler.needs_reconcile(NODE, renewed, later), "stale, and renewed since"
    assert not reconciler.needs_reconcile("gpu-node-b", renewed, later), "a report never seen"


def test_a_renewal_while_the_report_is_written_stale_is_queued() -> None:
    """A renewal told while a reconcile writes the report stale (after it judged, before the
    status landed) finds the verdict in force already stale, and is queued: none is lost
    between a judgement and its write."""
    later = NOW + DEFAULT_STALE_AFTER + timedelta(seconds=1)
    renewal: list[Renewal] = []
    api = ReportStatusApi()
    reconciler = reconciler_on(
        client.ApiClient(), reports_api=api, renewals=lambda node: renewal[-1] if renewal else None
    )
    nobody = PodLookup()
    assert not reconciler.reconcile(_report("7"), nobody, NOW), "fresh"
    while (taken := reconciler.queue.get(timeout=0)) is not None:
        reconciler.queue.done(taken[0])
    write = api.patch_cluster_custom_object_status

    def renewed_meanwhile(*args: Any, **kwargs: Any) -> Any:
        renewal.append(Renewal(f"gpuusage-system/{NODE}", later, witnessed=True))
        reconciler.liveness.renewed(NODE)  # as the Lease watch tells it, once it shows it
        return write(*args, **kwargs)

    api.patch_cluster_custom_object_status = renewed_meanwhile  # type: ignore[method-assign]
    assert reconciler.reconcile(_report("101", api.status), nobody, later), "judged stale"
    assert reconciler.queue.get(timeout=0) == (NODE, frozenset({RENEWED}))
    assert reconciler.needs_reconcile(NODE, frozenset({RENEWED}), later), "and it matters"
