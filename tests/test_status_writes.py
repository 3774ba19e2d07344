"""The operator's status writes send only what changed, and only onto the version they read.

A refresh of an unchanged report (the agent restating observedAt) moves the status's
generation bookkeeping and nothing else; sending the whole status for it cost about 7 kB per
node every five minutes (benchmarks/README.md). The diff is only right against the status it
was computed from, so it carries the report's resourceVersion, and the apiserver refuses it
when anyone wrote since; the whole status is sent then.
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.mergepatch import merge_diff
from gpuusage_operator.index.pods import PodLookup
from tests.builders import apply_merge_patch, reconciler_on
from tests.examples import example_spec

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def _without_nulls(value: Any) -> Any:
    """What a merge patch leaves stored: no null-valued keys (outside lists)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _document(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key in rng.sample("abcdef", rng.randint(0, 5)):
        kind = rng.random()
        if kind < 0.3 and depth < 3:
            doc[key] = _document(rng, depth + 1)
        elif kind < 0.45:
            doc[key] = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        elif kind < 0.55:
            doc[key] = [{"x": rng.randint(0, 2), "y": None}]
        elif kind < 0.65:
            doc[key] = None
        else:
            doc[key] = rng.choice([0, 1, "s", "t", True, False])
    return doc


def _mutated(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    """doc with some keys changed, removed or added, nested ones too."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        roll = rng.random()
        if roll < 0.15:
            continue
        if roll < 0.3:
            out[key] = _document(rng)
        elif isinstance(value, dict):
            out[key] = _mutated(rng, value)
        else:
            out[key] = value
    if rng.random() < 0.3:
        out[rng.choice("ghij")] = rng.choice([1, None, {"z": 2}, [1, 2]])
    return out


def test_the_diff_applied_to_the_old_document_gives_the_new_one() -> None:
    rng = random.Random(16)
    differing = 0
    for _ in range(2000):
        old = _document(rng)
        new = _mutated(rng, old) if rng.random() < 0.8 else old
        patch = merge_diff(old, new)
        stored = _without_nulls(old)
        assert _without_nulls(apply_merge_patch(stored, patch)) == _without_nulls(new)
        if new == old:
            assert patch == {}
        else:
            differing += 1
            assert all(old.get(k, "absent") != new.get(k, "absent") for k in patch)
    assert differing > 1000


def test_only_changed_keys_are_sent_lists_whole_and_removals_as_null() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2], "f": "gone"}
    new = {"a": 1, "b": {"c": 2, "d": 4}, "e": [1, 2, 3]}
    assert merge_diff(old, new) == {"b": {"d": 4}, "e": [1, 2, 3], "f": None}
    assert merge_diff(new, new) == {}


class Recorder:
    """The real status API, with the bodies sent kept for the test to read."""

    def __init__(self, api: client.ApiClient) -> None:
        self.real = client.CustomObjectsApi(api)
        self.bodies: list[dict[str, Any]] = []

    def patch_cluster_custom_object_status(self, *args: Any, **kwargs: Any) -> Any:
        self.bodies.append(json.loads(json.dumps(args[4])))
        return self.real.patch_cluster_custom_object_status(*args, **kwargs)


@pytest.mark.cluster
def test_a_refresh_costs_a_small_status_write_and_a_stale_read_the_whole_one(
    api: client.ApiClient,
) -> None:
    custom = client.CustomObjectsApi(api)
    group = (names.GROUP, names.VERSION, names.PLURAL)
    name = f"gpu-node-{uuid.uuid4().hex[:8]}"
    custom.create_cluster_custom_object(
        *group,
        {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "metadata": {"name": name},
            "spec": example_spec(name, T0).to_patch(),
        },
    )
    recorder = Recorder(api)
    reconciler = reconciler_on(api, reports_api=recorder)
    nobody = PodLookup()  # every process unattributed: no pod writes, the status is the test

    def get() -> dict[str, Any]:
        got = custom.get_cluster_custom_object(*group, name)
        assert isinstance(got, dict)
        return got

    reconciler.reconcile(get(), nobody, T0)
    first = recorder.bodies[-1]
    assert "metadata" not in first, "no status yet: the whole status, unconditionally"
    whole = len(json.dumps(first))

    # The agent's refresh: observedAt alone, a new generation.
    later = T0 + timedelta(minutes=5)
    custom.patch_cluster_custom_object(
        *group, name, {"spec": {"observedAt": later.isoformat().replace("+00:00", "Z")}}
    )
    refreshed = get()
    assert refreshed["metadata"]["generation"] == 2
    reconciler.reconcile(refreshed, nobody, later)
    small = recorder.bodies[-1]
    assert small["metadata"] == {"resourceVersion": refreshed["metadata"]["resourceVersion"]}
    assert set(small["status"]) == {"observedGeneration", "reportSeenAt", "conditions"}
    assert len(json.dumps(small)) < whole / 3
    stored = get()
    assert stored["status"]["observedGeneration"] == 2
    assert stored["status"]["unattributed"] == first["status"]["unattributed"]
    writes = reconciler.counts.status_writes
    reconciler.reconcile(stored, nobody, later)
    assert reconciler.counts.status_writes == writes, "what is stored is what was wanted"

    # Someone else writes the status; the operator then reconciles from its older read (the
    # report goes stale meanwhile): the apiserver refuses the diff, the whole status follows
    # and undoes the other write.
    custom.patch_cluster_custom_object_status(*group, name, {"status": {"totals": {"pods": 99}}})
    reconciler.reconcile(stored, nobody, later + timedelta(minutes=4))
    assert reconciler.counts.status_conflicts == 1
    assert "metadata" in recorder.bodies[-2], "the diff, refused"
    assert "metadata" not in recorder.bodies[-1], "then the whole status"
    final = get()["status"]
    assert final["totals"]["pods"] == 0
    stale = next(c for c in final["conditions"] if c["type"] == names.CONDITION_STALE)
    assert stale["status"] == "True"
