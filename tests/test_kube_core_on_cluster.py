"""kube.core.CoreApi on the real apiserver: each request the operator sends through it does
what CoreV1Api's does (lists and pages, a watch, patches of both kinds, a delete and an
eviction with the UID as precondition, a Node and its status), errors come back as the
client's ApiException, and the module spares the operator CoreV1Api's import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.kube import raw
from gpuusage.kube.core import CoreApi
from gpuusage.kube.errors import NotFound, translate
from gpuusage.kube.rest import MERGE_PATCH, STRATEGIC
from gpuusage_dev.simulation import create_running_pod, ensure_namespace

pytestmark = pytest.mark.cluster


def _json(response: Any) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(raw.body(response))
    return found


def test_pod_requests_do_what_core_v1_api_does(api: client.ApiClient) -> None:
    typed = client.CoreV1Api(api)
    ns = f"core-{uuid.uuid4().hex[:6]}"
    ensure_namespace(typed, ns)
    uids = {n: create_running_pod(typed, ns, n, "gpu-a", "main")[0] for n in ("a", "b", "c")}
    core = CoreApi(api)

    # Lists, paged, and by field.
    first = _json(core.list_namespaced_pod(ns, limit=2, _preload_content=False))
    assert len(first["items"]) == 2
    token = first["metadata"]["continue"]
    rest = _json(core.list_namespaced_pod(ns, limit=2, _continue=token, _preload_content=False))
    assert {p["metadata"]["uid"] for p in first["items"] + rest["items"]} == set(uids.values())
    one = _json(core.list_namespaced_pod(ns, field_selector="metadata.name=b"))
    assert [p["metadata"]["uid"] for p in one["items"]] == [uids["b"]]
    every = _json(core.list_pod_for_all_namespaces(limit=500, _preload_content=False))
    assert set(uids.values()) <= {p["metadata"]["uid"] for p in every["items"]}
    assert ns in {n["metadata"]["name"] for n in _json(core.list_namespace())["items"]}

    # A watch from the list's version hears a patch of the pod and of its status.
    version = every["metadata"]["resourceVersion"]
    stream = core.list_pod_for_all_namespaces(
        watch=True, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=10
    )
    patched = _json(
        core.patch_namespaced_pod(
            "a", ns, {"metadata": {"uid": uids["a"], "annotations": {"x": "1"}}}
        )
    )
    assert patched["metadata"]["annotations"]["x"] == "1"
    condition = {"type": "example.com/Probe", "status": "True", "reason": "Tested"}
    shown = _json(
        core.patch_namespaced_pod_status(
            "a", ns, {"status": {"conditions": [condition]}}, _content_type=STRATEGIC
        )
    )
    types = sorted(c["type"] for c in shown["status"]["conditions"])
    assert types == ["Ready", "example.com/Probe"], "a strategic merge keeps the other condition"
    heard = []
    for event in raw.json_lines(stream):
        meta = event["object"]["metadata"]
        if meta.get("uid") == uids["a"]:
            heard.append((event["type"], meta.get("annotations", {}).get("x")))
        if len(heard) == 2:
            break
    assert heard == [("MODIFIED", "1"), ("MODIFIED", "1")]
    assert _json(core.read_namespaced_pod("a", ns))["metadata"]["annotations"]["x"] == "1"

    # The UID as precondition: refused for another UID, done for the pod's own.
    with pytest.raises(ApiException) as refused:
        core.delete_namespaced_pod("b", ns, body={"preconditions": {"uid": str(uuid.uuid4())}})
    assert refused.value.status == 409
    raw.body(core.delete_namespaced_pod("b", ns, body={"preconditions": {"uid": uids["b"]}}))
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "c", "namespace": ns},
        "deleteOptions": {"preconditions": {"uid": uids["c"]}},
    }
    raw.body(core.create_namespaced_pod_eviction("c", ns, eviction))
    # No kubelet here confirms the end of a pod: each is left deleting.
    listed = _json(core.list_namespaced_pod(ns))["items"]
    deleting = {p["metadata"]["name"] for p in listed if p["metadata"].get("deletionTimestamp")}
    assert deleting == {"b", "c"}

    # Errors as CoreV1Api raises them; arguments it would not send, and names that are no
    # names, refused before anything is sent.
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nobody", ns)
    assert isinstance(translate(missing.value), NotFound)
    with pytest.raises(TypeError, match="pretty"):
        core.list_namespace(pretty="true")
    with pytest.raises(ValueError, match="not a name"):
        core.read_namespaced_pod("../../nodes/x", ns)


def test_a_node_and_its_status_are_patched(api: client.ApiClient) -> None:
    typed = client.CoreV1Api(api)
    name = f"core-node-{uuid.uuid4().hex[:6]}"
    typed.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
    core = CoreApi(api)
    try:
        body = {"metadata": {"annotations": {"example.com/mark": "yes"}}}
        raw.body(core.patch_node(name, body, _content_type=MERGE_PATCH))
        condition = {"type": "example.com/Probe", "status": "False", "reason": "Tested"}
        status = {"status": {"conditions": [condition]}}
        raw.body(core.patch_node_status(name, status, _content_type=STRATEGIC))
        node = _json(core.read_node(name, _preload_content=False))
        assert node["metadata"]["annotations"]["example.com/mark"] == "yes"
        assert [c["reason"] for c in node["status"]["conditions"]] == ["Tested"]
    finally:
        typed.delete_node(name)


def test_the_operator_is_built_without_core_v1_api() -> None:
    """A reason for the module: building the operator, policy actions on, imports no generated
    API class but the small one of custom objects (CoreV1Api's import alone holds 22 MiB).
    Clients before 37.0 import every class with the package: nothing to spare."""
    script = (
        "import sys, pathlib\n"
        "import kubernetes.client\n"
        "before = set(sys.modules)\n"
        "from gpuusage_operator.main import Operator\n"
        "from gpuusage_operator.settings import OperatorSettings\n"
        "config = pathlib.Path(sys.argv[1])\n"
        "config.write_text('apiVersion: v1\\nkind: Config\\nclusters: [{name: c, cluster: "
        '{server: "https://127.0.0.1:1"}}]\\nusers: [{name: u, user: {token: t}}]\\n'
        "contexts: [{name: x, context: {cluster: c, user: u}}]\\ncurrent-context: x\\n')\n"
        "Operator(OperatorSettings(kubeconfig=config, standalone=True, policy_actions=True))\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.startswith('kubernetes.client.api.')))\n"
        "print(len([m for m in before if m.startswith('kubernetes.client.api.')]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, "/tmp/gpuusage-core-test.kubeconfig"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout.splitlines()
    imported, with_the_package = json.loads(out[0].replace("'", '"')), int(out[1])
    if with_the_package:
        assert imported == [], "this client imports every API class with the package"
    else:
        assert imported == ["kubernetes.client.api.custom_objects_api"]
