"""Install the GpuNodeUsage CRD and wait until the apiserver serves it."""

from __future__ import annotations

import time
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api.crd import render_crd


def install_crd(api: client.ApiClient, timeout: float = 60.0) -> None:
    """Create or update the CRD (idempotent), then wait for Established=True.

    Waiting matters: objects of the new kind are refused until the apiserver has built the
    schema and registered the endpoints.
    """
    ext = client.ApiextensionsV1Api(api)
    body: dict[str, Any] = render_crd()
    name = body["metadata"]["name"]
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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        crd = ext.read_custom_resource_definition(name)
        conditions = (crd.status and crd.status.conditions) or []
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            return
        time.sleep(0.2)
    raise TimeoutError(f"CRD {name} not established after {timeout:.0f} s")
