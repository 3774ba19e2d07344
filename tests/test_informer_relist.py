"""An informer listed again on demand (Informer.relist): a new leader counts the last one's
enforced actions from a list begun after its term did, not from a watch that may lag behind.
Until that list is in, nothing counts as synced: no policy acts and no limit is counted.
On the real apiserver the watch is ended and the policies listed anew, with no fault logged."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage.kube.core import CoreApi
from gpuusage_operator.informers.namespacewatch import namespace_informer
from gpuusage_operator.informers.policywatch import PolicyState, PolicyWatch
from tests.builders import enforced_policy, policy_watch
from tests.conftest import wait_for
from tests.worldview import create_policy

NOW = datetime(2026, 11, 29, 4, 0, tzinfo=UTC)


def _page(*policies: dict[str, Any]) -> Any:
    page = {"metadata": {"resourceVersion": "7"}, "items": list(policies)}
    return SimpleNamespace(data=json.dumps(page).encode(), release_conn=lambda: None)


def _acted(name: str, *times: datetime) -> dict[str, Any]:
    policy = enforced_policy(name)
    policy["status"] = {"actedAt": [format_time(t) for t in times]}
    return policy


def test_a_relist_holds_the_counts_until_a_list_begun_after_it_is_in() -> None:
    state = PolicyState()
    watch = policy_watch(state)
    state.apply("ADDED", _acted("idle"))  # what the watch had brought: no action yet
    assert watch.acted(NOW) == {"idle": []}
    watch.policies.relist()
    assert watch.acted(NOW) is None, "nothing counted until the list is in"
    watch.policies._list_page = lambda limit, token: _page(_acted("idle", NOW))
    watch.policies.list_all()
    assert watch.acted(NOW + timedelta(minutes=1)) == {"idle": [NOW]}


def test_a_relist_asked_for_while_a_list_runs_leaves_it_unsynced() -> None:
    """That list may have been served before the relist was asked for: another must follow."""
    watch = policy_watch(PolicyState())

    def page(limit: int, token: str | None) -> Any:
        watch.policies.relist()  # the term begins while the first list is under way
        return _page(_acted("idle"))

    watch.policies._list_page = page
    watch.policies.synced.clear()
    watch.policies.list_all()
    assert not watch.policies.synced.is_set()
    watch.policies._list_page = lambda limit, token: _page(_acted("idle", NOW))
    watch.policies.list_all()
    assert watch.policies.synced.is_set()


@pytest.mark.cluster
def test_the_policies_are_listed_anew_on_the_apiserver_with_no_fault(
    api: client.ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"relist-{uuid.uuid4().hex[:6]}"
    custom = client.CustomObjectsApi(api)
    create_policy(api, name, enforced_policy(name)["spec"])
    namespaces = namespace_informer(CoreApi(api))
    watch = PolicyWatch(custom, namespaces)
    threading.Thread(target=namespaces.run, daemon=True).start()
    watch.start()
    try:
        wait_for(lambda: watch.synced and name in watch.policies.state.policies, what="listed")
        lists = watch.policies.relists
        acted = datetime.now(UTC).replace(microsecond=0)
        status = {"status": {"actedAt": [format_time(acted)]}}
        custom.patch_cluster_custom_object_status(
            names.GROUP, names.VERSION, names.POLICY_PLURAL, name, status
        )
        with caplog.at_level(logging.WARNING):
            watch.policies.relist()
            assert watch.acted(acted) is None
            counted = wait_for(lambda: watch.acted(acted), what="listed again")
        assert counted[name] == [acted]
        assert watch.policies.relists == lists + 1, "one list more"
        assert "interrupted" not in caplog.text, "a relist is no fault"
    finally:
        watch.stop()
        namespaces.stop()
        custom.delete_cluster_custom_object(names.GROUP, names.VERSION, names.POLICY_PLURAL, name)
