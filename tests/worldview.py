"""What a person would read off a simulated world: pods, their marks, reports and Events."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from kubernetes import client

from gpuusage.api import names
from tests.conftest import wait_for
from tests.simworld import SimWorld


class View(Protocol):
    """Where to look: a world (SimWorld), or any namespace and node of a cluster."""

    @property
    def api(self) -> client.ApiClient: ...

    @property
    def core(self) -> client.CoreV1Api: ...

    @property
    def ns(self) -> str: ...

    @property
    def node(self) -> str: ...


@dataclass(frozen=True)
class Place:
    """A namespace and a node of a cluster, looked at without a world around them."""

    api: client.ApiClient
    core: client.CoreV1Api
    ns: str
    node: str


def pod(world: View, name: str) -> client.V1Pod:
    found: client.V1Pod = world.core.read_namespaced_pod(name, world.ns)
    return found


def conditions(found: client.V1Pod) -> list[client.V1PodCondition]:
    return list((found.status.conditions if found.status else None) or [])


def condition(found: client.V1Pod) -> client.V1PodCondition:
    """Our GPUInUse condition; StopIteration (which wait_for takes as "not yet") without it."""
    return next(c for c in conditions(found) if c.type == names.POD_CONDITION_GPU_IN_USE)


def pod_annotations(world: View, name: str) -> dict[str, str]:
    meta = pod(world, name).metadata
    return dict((meta.annotations if meta else None) or {})


def report(world: View, node: str | None = None) -> dict[str, Any]:
    found = client.CustomObjectsApi(world.api).get_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, node or world.node
    )
    assert isinstance(found, dict)
    return found


def events(world: View, name: str) -> list[str]:
    listed = client.EventsV1Api(world.api).list_namespaced_event(world.ns)
    return sorted(str(e.reason) for e in listed.items if e.regarding and e.regarding.name == name)


def scrape(port: int) -> str:
    """The text of a /metrics endpoint on loopback."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def renewed_at(api: client.ApiClient, name: str, namespace: str) -> datetime | None:
    """A Lease's renewTime (None while there is no Lease or no renewal)."""
    found = client.CoordinationV1Api(api).read_namespaced_lease(name, namespace)
    return found.spec.renew_time if found.spec is not None else None


def in_namespace(namespace: str) -> dict[str, Any]:
    """A policy's namespace selector for one namespace (the label every namespace carries)."""
    return {"matchLabels": {"kubernetes.io/metadata.name": namespace}}


def create_policy(api: client.ApiClient, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Create the GpuUsagePolicy `name` with `spec`; the object as created."""
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.POLICY_KIND,
        "metadata": {"name": name},
        "spec": spec,
    }
    created: Any = client.CustomObjectsApi(api).create_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, body
    )
    return dict(created)


@contextmanager
def refusing(
    api: client.ApiClient, name: str, node: str, resource: str, operations: list[str]
) -> Iterator[None]:
    """While in the block, an admission policy `name` refuses these operations on this
    node's report (`resource`: gpunodeusages or gpunodeusages/status), as a webhook or a new
    schema may; policies are compiled asynchronously, so callers wait until it is in force."""
    admission = client.AdmissionregistrationV1Api(api)
    rule = {
        "apiGroups": [names.GROUP],
        "apiVersions": ["*"],
        "operations": operations,
        "resources": [resource],
    }
    admission.create_validating_admission_policy(
        {  # type: ignore[arg-type]
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [rule]},
                "matchConditions": [
                    {"name": "this-node", "expression": f"object.metadata.name == '{node}'"}
                ],
                "validations": [{"expression": "false", "message": "refused by a test policy"}],
            },
        }
    )
    admission.create_validating_admission_policy_binding(
        {  # type: ignore[arg-type]
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        }
    )
    try:
        yield
    finally:
        admission.delete_validating_admission_policy_binding(name)
        admission.delete_validating_admission_policy(name)


def refreshed_rarely(world: SimWorld, timeout: float = 30.0) -> int:
    """The report's generation once its agent refreshes it only rarely (every 60 s in the
    worlds with Leases): the status says the Lease is what counts, and two renewals of the
    agent's Lease (five of its 1 s heartbeats) came with no write of the report. Before that
    the agent rewrites it every heartbeat, and a test of what happens without a new report
    would see new ones."""

    def settled() -> int | None:
        found = report(world)
        listed = (found.get("status") or {}).get("conditions") or []
        stale: dict[str, Any] = next((c for c in listed if c["type"] == "Stale"), {})
        if stale.get("reason") != names.STALE_REASON_LEASE:
            return None
        generation: int = found["metadata"]["generation"]
        seen = [renewed_at(world.api, world.node, world.ns)]
        while len(seen) < 3:
            seen.append(
                wait_for(
                    lambda: (t := renewed_at(world.api, world.node, world.ns)) != seen[-1] and t,
                    what="the agent's Lease renewed",
                )
            )
        return generation if report(world)["metadata"]["generation"] == generation else None

    found: int = wait_for(settled, timeout, what="the report refreshed only rarely")
    return found
