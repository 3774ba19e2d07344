"""An informer listed again on demand (Informer.relist): a new leader counts the last one's
enforced actions from a list begun after its term did, not from a watch that may lag behind.
Until that list is in, nothing counts as synced: no policy acts and no limit is counted.
On the real apiserver the watch is ended and the policies listed anew, with no fault logged."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import urllib3
from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage.kube import raw
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


class _OneEvent(http.server.BaseHTTPRequestHandler):
    """A watch that sends one event and ends, as the apiserver's does at its timeout."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        data = b'{"type":"ADDED","object":{}}\n'
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))

    def log_message(self, *args: Any) -> None:
        pass


def test_a_watch_that_ended_is_ended_again_without_complaint() -> None:
    """relist() or stop() between two watches: the last watch's response went back to the
    pool, whose shutdown urllib3 refuses (RuntimeError); the new term must go on all the same."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OneEvent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pool = urllib3.PoolManager()
        response = pool.request(
            "GET", f"http://127.0.0.1:{server.server_port}/", preload_content=False
        )
        assert list(raw.json_lines(response)) == [{"type": "ADDED", "object": {}}]
        raw.shutdown(response)  # released to the pool: nothing to end, nothing raised
        watch = policy_watch(PolicyState())
        watch.policies._stream = response  # as if the loop had not cleared it yet
        watch.policies.relist()
        watch.policies.stop()
        assert not watch.policies.synced.is_set()
    finally:
        server.shutdown()
