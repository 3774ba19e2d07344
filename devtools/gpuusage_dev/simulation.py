"""A simulated GPU node on a bare control plane: pods that look running (their processes'
/proc tree is written by `proctree`).

A bare apiserver has no kubelet, so nothing fills in pod status; the demo and the tests write
it themselves (phase, container IDs) through pods/status, exactly where a kubelet would.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api.times import format_time


class Background:
    """A loop (agent, operator) run in a thread until halt(); it receives the stop event."""

    def __init__(self, target: Callable[[threading.Event], Any]) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=target, args=(self.stop,), daemon=True)
        self.thread.start()

    def halt(self, timeout: float = 30.0) -> None:
        self.stop.set()
        self.thread.join(timeout=timeout)


def ensure_namespace(core: client.CoreV1Api, namespace: str) -> None:
    """A namespace with its `default` ServiceAccount (no controller-manager creates it here);
    either may exist already."""
    for create in (
        lambda: core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
        ),
        lambda: core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="default"))
        ),
    ):
        try:
            create()
        except ApiException as exc:
            if exc.status != 409:
                raise


def create_running_pod(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    node: str,
    container: str,
    *,
    gpus: int = 1,
    annotations: Mapping[str, str] | None = None,
    claims: Mapping[str, str] | None = None,
    templates: Mapping[str, str] | None = None,
    resources: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """A pod bound to node whose container is reported running; returns (pod UID, container ID).

    The container asks for `gpus` nvidia.com/gpu (0: none, as a pod that reaches the GPUs
    through NVIDIA_VISIBLE_DEVICES=all would). `claims` names ResourceClaims (reference →
    claim name); `templates` claims from a template (reference → the claim the control plane
    generated, named in the pod's status as the resourceclaim controller does); `resources`,
    more extended resources in the container's limits."""
    limits = {**({"nvidia.com/gpu": str(gpus)} if gpus else {}), **(resources or {})}
    resource_claims = [
        client.V1PodResourceClaim(name=ref, resource_claim_name=claim)
        for ref, claim in (claims or {}).items()
    ] + [
        client.V1PodResourceClaim(name=ref, resource_claim_template_name=f"{ref}-template")
        for ref in templates or {}
    ]
    created = core.create_namespaced_pod(
        namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, annotations=dict(annotations or {}) or None),
            spec=client.V1PodSpec(
                node_name=node,
                resource_claims=resource_claims or None,
                containers=[
                    client.V1Container(
                        name=container,
                        image="registry.example/app:1",
                        resources=client.V1ResourceRequirements(limits=limits or None),
                    )
                ],
            ),
        ),
    )
    assert created.metadata is not None
    container_id = uuid.uuid4().hex + uuid.uuid4().hex
    status = {
        "phase": "Running",
        "startTime": format_time(datetime.now(UTC)),
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {
                "name": container,
                "ready": True,
                "restartCount": 0,
                "started": True,
                "image": "registry.example/app:1",
                "imageID": "sha256:" + "0" * 64,
                "containerID": f"containerd://{container_id}",
                "state": {"running": {}},
            }
        ],
    }
    if templates:
        status["resourceClaimStatuses"] = [
            {"name": ref, "resourceClaimName": claim} for ref, claim in templates.items()
        ]
    core.patch_namespaced_pod_status(name, namespace, {"status": status})
    return str(created.metadata.uid), container_id


DRA_DRIVER = "gpu.nvidia.com"


def create_gpu_slice(
    resource: Any, node: str, devices: list[dict[str, str]], version: str = "v1"
) -> str:
    """A ResourceSlice as NVIDIA's DRA driver publishes it for `node` (pool = the node's name),
    through `resource`, the client's API of resource.k8s.io/`version` (v1beta1 nests a device's
    attributes under `basic`).

    Each device: {"name", "type" (gpu|mig), "uuid"?, "parentUUID"?, "profile"?}; a MIG device
    without "uuid" is one created at prepare time."""
    listed = []
    for device in devices:
        attributes = {
            key: {"string": device[key]}
            for key in ("type", "uuid", "parentUUID", "profile")
            if device.get(key)
        }
        if version == "v1beta1":
            listed.append({"name": device["name"], "basic": {"attributes": attributes}})
        else:
            listed.append({"name": device["name"], "attributes": attributes})
    name = f"{node}-{DRA_DRIVER}-{uuid.uuid4().hex[:5]}"
    body: Any = {  # the client takes the object as the API does
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": listed,
        },
    }
    resource.create_resource_slice(body)
    return name


def create_allocated_claim(
    resource: Any,
    namespace: str,
    name: str,
    node: str,
    devices: list[str],
    *,
    driver: str = DRA_DRIVER,
    version: str = "v1",
    sharing: dict[str, Any] | None = None,
    reserved_for: dict[str, str] | None = None,
) -> None:
    """A ResourceClaim for len(devices) GPUs, allocated as the scheduler writes it: one result
    per device of `driver`'s pool on `node` (through the API of resource.k8s.io/`version`;
    v1beta1 states the request flat, later versions under `exactly`). `sharing`: the `sharing`
    of an NVIDIA GpuConfig in its device config, which the allocation carries too;
    `reserved_for`: the pods it is reserved for, by name and UID."""
    request: dict[str, Any] = {
        "deviceClassName": driver,
        "allocationMode": "ExactCount",
        "count": len(devices),
    }
    claim: Any = {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", **request}
                    if version == "v1beta1"
                    else {"name": "gpu", "exactly": request}
                ]
            }
        },
    }
    config: list[dict[str, Any]] = []
    if sharing is not None:
        parameters = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": sharing,
        }
        config = [{"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}]
        claim["spec"]["devices"]["config"] = config
    resource.create_namespaced_resource_claim(namespace, claim)
    results = [
        {"request": "gpu", "driver": driver, "pool": node, "device": device} for device in devices
    ]
    allocated: dict[str, Any] = {"results": results}
    if config:
        allocated["config"] = [{"source": "FromClaim", **c} for c in config]
    status: dict[str, Any] = {"allocation": {"devices": allocated}}
    if reserved_for:
        status["reservedFor"] = [
            {"resource": "pods", "name": pod, "uid": uid} for pod, uid in reserved_for.items()
        ]
    resource.patch_namespaced_resource_claim_status(name, namespace, {"status": status})
