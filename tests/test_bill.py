"""The bill of use over a window in `gpuusage top --by namespace --window`.

The PromQL top sends is evaluated by promtool on kube-state-metrics' scraped series in
test_monitoring.py (the real tools); here: the queries' text, reading Prometheus' answers, the
refusals, and the command against the real apiserver with Prometheus' HTTP API served by a
stand-in that answers what a test says (no Prometheus server is built here).
"""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpuusage.api import names
from gpuusage.errors import GpuusageError
from gpuusage_commands.bill import (
    RULES,
    Bill,
    BillError,
    bills,
    cells,
    query,
    read_vector,
    window_minutes,
)
from gpuusage_commands.promaccess import prometheus_access
from gpuusage_commands.prometheus import PrometheusError, base_url, instant_query
from gpuusage_commands.top import TopSettings, _checked, read_bills
from gpuusage_dev.localcluster.cluster import LocalCluster
from tests.builders import status_pod, status_report
from tests.conftest import gpuusage_cli

SUFFIX = uuid.uuid4().hex[:5]
"""Names of this module's namespaces and node, apart from other runs'."""


def _vector(values: dict[str, float]) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"namespace": ns}, "value": [1795521600.0, repr(v)]}
                for ns, v in values.items()
            ],
        },
    }


Answer = Callable[[str], tuple[int, bytes]]


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[dict[str, str]], list[Answer]]]:
    """A stand-in for Prometheus' HTTP API: the requests it got (path, parameters, and each
    header under "header <name>"), and the answer to give (a function of the query; replace
    answer[0]; a redirect's body is where it leads)."""
    seen: list[dict[str, str]] = []
    answer: list[Answer] = [lambda q: (200, json.dumps(_vector({})).encode())]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parsed = urllib.parse.urlsplit(self.path)
            params = dict(urllib.parse.parse_qsl(parsed.query))
            heard = {f"header {k.lower()}": v for k, v in self.headers.items()}
            seen.append({"path": parsed.path, **params, **heard})
            code, body = answer[0](params.get("query", ""))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            if 300 <= code < 400:
                self.send_header("Location", body.decode())
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen, answer
    finally:
        server.shutdown()
        server.server_close()


def test_windows_as_prometheus_writes_them() -> None:
    assert [window_minutes(w) for w in ("90m", "24h", "7d", "1h30m", "1d12h")] == [
        90,
        1440,
        10080,
        90,
        2160,
    ]
    for bad in ("", "24", "1w", "24 h", "0m", "-1h", "1.5h"):
        with pytest.raises(BillError, match="--window"):
            window_minutes(bad)


def test_each_column_sums_its_showback_rule_over_the_window() -> None:
    assert query("handed", "24h") == (
        "sum by (namespace) (sum_over_time(namespace:gpuusage_gpus_allocated:sum[24h])) / 60"
    )
    assert query("memory", "7d", "ml") == (
        "sum by (namespace) (sum_over_time("
        'namespace:gpuusage_gpu_memory_used_mib:sum{namespace="ml"}[7d])) / 61440'
    )
    assert set(RULES) == {"handed", "held", "computing", "compute", "untold", "memory"}
    assert query("compute", "1h") == (
        "sum by (namespace) (sum_over_time(namespace:gpuusage_gpu_compute_share:sum[1h])) / 60"
    )


def test_answers_are_read_and_anything_else_is_named() -> None:
    assert read_vector(_vector({"ml": 2.5, "web": 0.0})) == {"ml": 2.5, "web": 0.0}
    with pytest.raises(BillError, match="refused the query: parse error"):
        read_vector({"status": "error", "error": "parse error"})
    with pytest.raises(BillError, match="expected a vector"):
        read_vector({"status": "success", "data": {"resultType": "matrix", "result": []}})
    with pytest.raises(BillError, match="unreadable sample"):
        read_vector(
            {
                "status": "success",
                "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1]}]},
            }
        )


def test_a_bill_and_its_efficiency() -> None:
    found = bills(
        {
            "handed": {"ml": 4.0},
            "held": {"ml": 2.0, "sneaky": 1.0},
            "computing": {"ml": 1.5},
            "compute": {"ml": 0.9},
            "untold": {"ml": 0.25},
            "memory": {"ml": 59.5},
        }
    )
    assert found["ml"] == Bill("ml", 4.0, 2.0, 1.5, 59.5, compute=0.9, untold=0.25)
    assert cells(found["ml"]) == ["4.0", "2.0", "1.5", "0.9", "0.2", "59.5", "50%", "38%"]
    assert found["sneaky"] == Bill("sneaky", held=1.0), "used without anything handed"
    assert cells(found["sneaky"])[-2:] == ["-", "-"], "no ratio without a GPU-hour handed"


def test_what_cannot_work_is_refused_before_asking_anyone() -> None:
    with pytest.raises(GpuusageError, match="--window needs --by namespace"):
        _checked(TopSettings(window="24h"))
    with pytest.raises(GpuusageError, match="--window needs --prometheus"):
        _checked(TopSettings(window="24h", by="namespace"))
    with pytest.raises(GpuusageError, match="--window '1 day'"):
        _checked(TopSettings(window="1 day", by="namespace", prometheus="http://p:9090"))
    with pytest.raises(PrometheusError, match="base URL"):
        base_url("prometheus:9090")


def test_the_bill_is_asked_of_prometheus_one_query_a_column(
    prometheus: tuple[str, list[dict[str, str]], list[Answer]],
) -> None:
    url, seen, answer = prometheus
    hours = {
        "handed": 4.0,
        "held": 2.0,
        "computing": 1.5,
        "compute": 0.75,
        "untold": 0.5,
        "memory": 59.5,
    }
    answer[0] = lambda q: (
        200,
        json.dumps(_vector({"ml": next(v for c, v in hours.items() if RULES[c][0] in q)})).encode(),
    )
    assert read_bills(url + "/", "24h", None, at=1795521600.0) == {
        "ml": Bill("ml", 4.0, 2.0, 1.5, 59.5, compute=0.75, untold=0.5)
    }
    assert [s["query"] for s in seen] == [query(c, "24h") for c in RULES]
    assert {(s["path"], s["time"]) for s in seen} == {("/api/v1/query", "1795521600.000")}


def test_prometheus_failures_are_one_clear_message(
    prometheus: tuple[str, list[dict[str, str]], list[Answer]],
) -> None:
    url, _seen, answer = prometheus
    answer[0] = lambda q: (400, b'{"status":"error","errorType":"bad_data","error":"parse error"}')
    with pytest.raises(PrometheusError, match="refused the query: parse error"):
        instant_query(url, "up")
    answer[0] = lambda q: (200, b"<html>login</html>")
    with pytest.raises(PrometheusError, match="not JSON"):
        instant_query(url, "up")
    answer[0] = lambda q: (503, b"overloaded")
    with pytest.raises(PrometheusError, match="503"):
        instant_query(url, "up")
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(PrometheusError, match=r"cannot reach Prometheus at http://127\.0\.0\.1:9"):
        instant_query(closed, "up", timeout=5)


def test_the_access_goes_with_every_query_and_never_on_a_redirect(
    prometheus: tuple[str, list[dict[str, str]], list[Answer]], tmp_path: Path
) -> None:
    url, seen, answer = prometheus
    (tmp_path / "token").write_text("s3cret-token\n")
    access = prometheus_access(
        token_file=tmp_path / "token", headers=["X-Scope-OrgID: tenant-a", "X-Other: b"]
    )
    read_bills(url, "24h", None, at=1795521600.0, access=access)
    assert len(seen) == len(RULES)
    for request in seen:
        assert request["header authorization"] == "Bearer s3cret-token"
        assert request["header x-scope-orgid"] == "tenant-a"
        assert request["header x-other"] == "b"
    # A redirect may lead anywhere: the credentials and headers stay behind, and the refusal
    # that follows says so.
    seen.clear()
    answer[0] = lambda q: (307, b"/moved") if q else (401, b"Unauthorized\n")
    with pytest.raises(PrometheusError) as refused:
        instant_query(url, "up", access=access)
    assert [s["path"] for s in seen] == ["/api/v1/query", "/moved"]
    assert "header authorization" not in seen[1]
    assert "header x-scope-orgid" not in seen[1]
    assert str(refused.value) == (
        f"Prometheus refused the credentials: 401 Unauthorized from {url} (a bearer token "
        f"from {tmp_path / 'token'}, not sent on the redirect to {url}/moved: give that "
        "URL): Unauthorized"
    )


def test_a_refusal_of_the_credentials_says_what_was_sent_and_not_the_secret(
    prometheus: tuple[str, list[dict[str, str]], list[Answer]], tmp_path: Path
) -> None:
    url, _seen, answer = prometheus
    (tmp_path / "password").write_text("s3cret-password")
    basic = prometheus_access(user="alice", password_file=tmp_path / "password")
    answer[0] = lambda q: (401, b"Unauthorized\n")
    with pytest.raises(PrometheusError) as refused:
        instant_query(url, "up", access=basic)
    assert str(refused.value) == (
        f"Prometheus refused the credentials: 401 Unauthorized from {url} (basic auth as user "
        "'alice'): Unauthorized"
    )
    answer[0] = lambda q: (401, b"no org id\n")  # Mimir without X-Scope-OrgID
    with pytest.raises(PrometheusError) as refused:
        instant_query(url, "up")
    assert str(refused.value) == (
        f"Prometheus refused the credentials: 401 Unauthorized from {url} (no credentials; "
        "give --prometheus-token-file, or --prometheus-user and --prometheus-password-file): "
        "no org id"
    )
    answer[0] = lambda q: (403, b"")
    with pytest.raises(PrometheusError, match=r"refused the credentials: 403 Forbidden from"):
        instant_query(url, "up", access=basic)


@pytest.mark.cluster
def test_top_shows_the_bill_beside_the_namespaces_now(
    cluster: LocalCluster,
    api: client.ApiClient,
    prometheus: tuple[str, list[dict[str, str]], list[Answer]],
) -> None:
    """The namespaces now (from the reports) with their hours (from Prometheus); a namespace
    billed in the window that uses nothing now has a row too; the window is stated."""
    url, seen, answer = prometheus
    ns, gone = f"bill-{SUFFIX}", f"gone-{SUFFIX}"
    node = f"bill-node-{SUFFIX}"
    report = status_report(
        node, {"GPU-eee": [{**status_pod(ns, "train", 4096, [7]), "computing": True}]}
    )
    custom = client.CustomObjectsApi(api)
    body = {k: report[k] for k in ("metadata", "spec")}
    custom.create_cluster_custom_object(
        names.GROUP,
        names.VERSION,
        names.PLURAL,
        {"apiVersion": names.API_VERSION, "kind": names.KIND, **body},
    )
    custom.patch_cluster_custom_object_status(
        names.GROUP, names.VERSION, names.PLURAL, node, {"status": report["status"]}
    )
    hours = {
        "handed": {ns: 24.0, gone: 8.0},
        "held": {ns: 12.0, gone: 8.0},
        "computing": {ns: 6.0},
        "compute": {ns: 4.5},
        "untold": {ns: 1.0},
        "memory": {ns: 96.0, gone: 640.0},
    }
    answer[0] = lambda q: (
        200,
        json.dumps(_vector(next(v for c, v in hours.items() if RULES[c][0] in q))).encode(),
    )

    def top(*args: str) -> subprocess.CompletedProcess[str]:
        return gpuusage_cli(cluster.kubeconfig, "top", "--by", "namespace", *args)

    try:
        shown = top("--window", "24h", "--prometheus", url)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].split()[-8:] == [
            "GPU-H",
            "HELD-H",
            "COMPUTING-H",
            "COMPUTE-H",
            "NO-SHARE-H",
            "GIB-H",
            "HELD/GPU-H",
            "COMPUTING/GPU-H",
        ]
        rows = {line.split()[0]: line.split() for line in lines[1:-1]}
        assert rows[ns][3] == "1", "computing now"
        assert rows[ns][-8:] == ["24.0", "12.0", "6.0", "4.5", "1.0", "96.0", "50%", "25%"]
        assert rows[gone][1:4] == ["0", "0", "0"], "nothing now"
        assert rows[gone][-8:] == ["8.0", "8.0", "0.0", "0.0", "0.0", "640.0", "100%", "0%"]
        assert "over the 24h to " in lines[-1]
        assert url in lines[-1]
        assert {s["query"] for s in seen} == {query(c, "24h") for c in RULES}
        as_json = json.loads(top("--window", "24h", "--prometheus", url, "-o", "json").stdout)
        assert as_json["window"] == "24h"
        billed = {i["namespace"]: i["bill"] for i in as_json["items"]}
        assert billed[ns]["computing"] == 6.0
        assert billed[ns]["compute"] == 4.5
        # Prometheus down: one line saying so, exit code 1, no table.
        down = top("--window", "24h", "--prometheus", "http://127.0.0.1:9")
        assert down.returncode != 0
        assert "cannot reach Prometheus at http://127.0.0.1:9" in down.stderr
        assert "Traceback" not in down.stderr
        assert down.stdout == ""
    finally:
        custom.delete_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, node)
