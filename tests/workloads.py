"""Workloads on the tests' apiserver as their controllers would have made them: no controller
manager runs there, so a Deployment's ReplicaSet and the ownership of its pod are made by hand,
and an autoscaler or a scale only ever changes what is written."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kubernetes import client

from gpuusage.kube import raw

AUTOSCALERS = ("autoscaling", "v2", "horizontalpodautoscalers")


def controller_ref(owner: dict[str, Any]) -> dict[str, Any]:
    """An owner reference naming `owner` (as created) as the controller."""
    meta = owner["metadata"]
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"]}
    return {**ref, "uid": meta["uid"], "controller": True}


def made(response: Any) -> dict[str, Any]:
    """An object as the apiserver answered it, as JSON."""
    found: dict[str, Any] = json.loads(raw.body(response))
    return found


def _apps_object(
    api: client.ApiClient,
    ns: str,
    kind: str,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    selector = {"app": name}
    body = {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {
            "name": name,
            "labels": labels or {},
            "annotations": annotations or {},
            "ownerReferences": [controller_ref(owner)] if owner else [],
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": {"containers": [{"name": "main", "image": "registry.example/app:1"}]},
            },
        },
    }
    plural = {"Deployment": "deployments", "ReplicaSet": "replicasets"}[kind]
    response = client.CustomObjectsApi(api).create_namespaced_custom_object(
        "apps", "v1", ns, plural, body, _preload_content=False
    )
    return made(response)


def deployment_of(
    api: client.ApiClient,
    ns: str,
    pod: str,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Make Deployment `name` (one replica, these labels and annotations) and its ReplicaSet,
    and hand the running pod to that ReplicaSet; the Deployment as created."""
    made = _apps_object(api, ns, "Deployment", name, labels=labels, annotations=annotations)
    replica_set_of(api, ns, pod, f"{name}-5d4f8", owner=made)
    return made


def replica_set_of(
    api: client.ApiClient, ns: str, pod: str, name: str, *, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """Make ReplicaSet `name` (controlled by `owner`, if any) and hand the pod to it."""
    made = _apps_object(api, ns, "ReplicaSet", name, owner=owner)
    patch = {"metadata": {"ownerReferences": [controller_ref(made)]}}
    client.CoreV1Api(api).patch_namespaced_pod(pod, ns, patch)
    return made


def replicas(api: client.ApiClient, ns: str, kind: str, name: str) -> int:
    """The replicas the workload's spec asks for."""
    plural = {"Deployment": "deployments", "ReplicaSet": "replicasets"}[kind]
    found: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "apps", "v1", ns, plural, name
    )
    return int(found["spec"]["replicas"])


def autoscaler(
    api: client.ApiClient,
    ns: str,
    name: str,
    target: str,
    *,
    labels: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
) -> None:
    """A HorizontalPodAutoscaler of Deployment `target` (minReplicas 1, the default; `owner`:
    the object that made it, as KEDA's ScaledObject owns its own)."""
    body = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": name,
            "labels": labels or {},
            "ownerReferences": [owner] if owner else [],
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 80},
                    },
                }
            ],
        },
    }
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        *AUTOSCALERS[:2], ns, AUTOSCALERS[2], body
    )


KEDA_OWNED = {"app.kubernetes.io/managed-by": "keda-operator"}
"""The label KEDA puts on the autoscaler it makes for a ScaledObject."""


def scaled_object_ref(name: str) -> dict[str, Any]:
    """An owner reference to a KEDA ScaledObject (its CRD need not be served: no garbage
    collector runs here)."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "name": name,
        "uid": str(uuid.uuid4()),
        "controller": True,
    }
