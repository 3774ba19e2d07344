"""The enforced actions of policies, against the API: each reads the pod's controlling owners
and changes what a person would change, through the API a person would use.

* ScaleToZero: the pod's controlling workload through its `scale` subresource (a Deployment
  through its ReplicaSet, a StatefulSet, a ReplicaSet of its own); its controller deletes the
  pod and the GPU is free, and scaling back up is the owner's choice.
* Suspend: the pod's controlling batch Job, `spec.suspend: true` (its controller deletes the
  Job's running pods; resuming is the owner's choice).
* DeletePod: a pod no controller owns (a controller would only make another one).
* Evict: the Eviction API, so that PodDisruptionBudgets hold: a refusal (429) is no failure to
  force through, it is tried again later.

Every write carries the object's UID as a precondition where the API takes one, so a pod or
workload recreated under the same name is never acted upon. The rights come only with the
install's policy-actions part; without them the apiserver answers 403 and the outcome says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes import client

from gpuusage.kube import raw
from gpuusage.kube.errors import Conflict, Forbidden, NotFound, is_other_object, translate

Outcome = Literal["Done", "Refused", "RateLimited", "NotPermitted", "NotApplicable", "Gone"]


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str


SCALABLE = {"Deployment": "deployments", "StatefulSet": "statefulsets", "ReplicaSet": "replicasets"}


def controller_of(meta: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(kind, name, uid) of the object's controlling owner, if any."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind")), str(ref.get("name")), str(ref.get("uid"))
    return None


def _read(response: Any) -> dict[str, Any]:
    """The metadata of an object read raw (the client's models cost more than they give)."""
    found = json.loads(raw.body(response)).get("metadata") or {}
    return dict(found)


class Actor:
    """Carries out enforced actions on pods through `api`."""

    def __init__(self, api: client.ApiClient) -> None:
        self._core = client.CoreV1Api(api)
        self._apps = client.AppsV1Api(api)
        self._batch = client.BatchV1Api(api)
        self._policy = client.PolicyV1Api(api)

    def act(self, namespace: str, name: str, uid: str, action: str) -> Result:
        try:
            meta = _read(self._core.read_namespaced_pod(name, namespace, _preload_content=False))
            if meta.get("uid") != uid:
                return Result("Gone", f"pod {namespace}/{name} is another pod now")
            if action == "ScaleToZero":
                return self._scale_to_zero(namespace, meta)
            if action == "Suspend":
                return self._suspend(namespace, meta)
            if action == "DeletePod":
                return self._delete(namespace, name, uid, meta)
            if action == "Evict":
                return self._evict(namespace, name, uid)
            return Result("NotApplicable", f"{action} is not an action on pods")
        except Exception as exc:
            error = translate(exc)
            if isinstance(error, NotFound | Conflict) or is_other_object(error):
                return Result("Gone", f"pod {namespace}/{name} or its owner is gone or replaced")
            if isinstance(error, Forbidden):
                return Result("NotPermitted", f"the operator may not {action}: {error}")
            if error.status == 429:  # a PodDisruptionBudget, or the apiserver's own limits
                return Result("Refused", f"refused for now: {error}")
            raise error from exc

    def _scale_to_zero(self, namespace: str, meta: Mapping[str, Any]) -> Result:
        owner = controller_of(meta)
        if owner is not None and owner[0] == "ReplicaSet":
            rs = self._apps.read_namespaced_replica_set(owner[1], namespace, _preload_content=False)
            above = controller_of(_read(rs))
            if above is not None and above[0] == "Deployment":
                owner = above
        if owner is None or owner[0] not in SCALABLE:
            return Result("NotApplicable", "no Deployment, StatefulSet or ReplicaSet owns the pod")
        kind, workload, _ = owner
        body = {"spec": {"replicas": 0}}
        patch = {
            "Deployment": self._apps.patch_namespaced_deployment_scale,
            "StatefulSet": self._apps.patch_namespaced_stateful_set_scale,
            "ReplicaSet": self._apps.patch_namespaced_replica_set_scale,
        }[kind]
        patch(workload, namespace, body)
        return Result("Done", f"scaled {kind} {namespace}/{workload} to zero")

    def _suspend(self, namespace: str, meta: Mapping[str, Any]) -> Result:
        owner = controller_of(meta)
        if owner is None or owner[0] != "Job":
            return Result("NotApplicable", "no Job owns the pod")
        _, job, job_uid = owner
        self._batch.patch_namespaced_job(
            job, namespace, {"metadata": {"uid": job_uid}, "spec": {"suspend": True}}
        )
        return Result("Done", f"suspended Job {namespace}/{job}")

    def _delete(self, namespace: str, name: str, uid: str, meta: Mapping[str, Any]) -> Result:
        owner = controller_of(meta)
        if owner is not None:
            return Result(
                "NotApplicable", f"{owner[0]} {owner[1]} owns the pod: it would make another"
            )
        self._core.delete_namespaced_pod(
            name,
            namespace,
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
        return Result("Done", f"deleted pod {namespace}/{name}")

    def _evict(self, namespace: str, name: str, uid: str) -> Result:
        eviction = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
        self._core.create_namespaced_pod_eviction(name, namespace, eviction)
        return Result("Done", f"evicted pod {namespace}/{name}")
