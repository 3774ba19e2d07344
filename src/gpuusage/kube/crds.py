"""Install the CRDs and wait until the apiserver serves them."""

from __future__ import annotations

import time
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.api.crd import render_crd, render_policy_crd
from gpuusage.retry import poll_until


def _apply_crd(ext: client.ApiextensionsV1Api, body: dict[str, Any]) -> str:
    name = str(body["metadata"]["name"])
    # The client sends plain dicts as they are; the typed signature only names the model class.
    typed = cast(client.V1CustomResourceDefinition, body)
    try:
        ext.create_custom_resource_definition(typed)
    except ApiException as exc:
        if exc.status != 409:
            raise
        current = ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata and current.metadata.resource_version
        ext.replace_custom_resource_definition(name, typed)
    return name


def _wait_established(ext: client.ApiextensionsV1Api, name: str, timeout: float) -> None:
    def established() -> bool:
        crd = ext.read_custom_resource_definition(name)
        conditions = (crd.status and crd.status.conditions) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    if not poll_until(established, timeout, 0.2):
        raise TimeoutError(f"CRD {name} not established in time")


def _wait_served(api: client.ApiClient, timeout: float) -> None:
    """Established is not yet served: right after it, a list is refused for a moment (429,
    "storage is (re)initializing"), which an operator started then logs as an error."""
    custom = client.CustomObjectsApi(api)

    def served() -> bool:
        try:
            custom.list_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, limit=1)
        except ApiException as exc:
            if exc.status in (404, 429, 503):
                return False
            raise
        return True

    if not poll_until(served, timeout, 0.2):
        raise TimeoutError(f"{names.PLURAL}.{names.GROUP} not served in time")


def install_crds(api: client.ApiClient, timeout: float = 60.0) -> None:
    """Create or update our CRDs (idempotent) and wait for Established=True.

    Waiting matters: objects of a new kind are refused until the apiserver has built the
    schema and registered the endpoints.
    """
    ext = client.ApiextensionsV1Api(api)
    deadline = time.monotonic() + timeout
    created = [_apply_crd(ext, render()) for render in (render_crd, render_policy_crd)]
    for name in created:
        _wait_established(ext, name, max(0.0, deadline - time.monotonic()))
    _wait_served(api, max(0.0, deadline - time.monotonic()))
