"""The enforced actions of policies, against the API: each reads the pod's controlling owners
and changes what a person would change, through the API a person would use.

* ScaleToZero: the pod's controlling workload through its `scale` subresource (a Deployment
  through its ReplicaSet, a StatefulSet, a ReplicaSet of its own); its controller deletes the
  pod and the GPU is free, and scaling back up is the owner's choice. A Kubeflow Notebook's
  StatefulSet would be scaled up again by the notebook controller: the Notebook is stopped
  instead, with the annotation its controller reads (kubeflow-resource-stopped, as its culler
  does). A ReplicaSet or StatefulSet that another controller owns (an Argo Rollout, say) is
  left alone: its controller would scale it back.
* Suspend: the pod's controlling batch Job, `spec.suspend: true` (its controller deletes the
  Job's running pods; resuming is the owner's choice). A Job of a JobSet is suspended through
  its JobSet, and a Job that Kueue manages (its queue-name label) through its Workload
  (`spec.active: false`, Kueue's own way to stop a workload): either controller would undo a
  suspension of the Job itself.
* DeletePod: a pod no controller owns (a controller would only make another one).
* Evict: the Eviction API, so that PodDisruptionBudgets hold: a refusal (429) is no failure to
  force through, it is tried again later.

Before it scales or suspends a workload it asks policies.neighbours whether a GitOps tool or
an autoscaler would undo that (the Deployment, StatefulSet or ReplicaSet, the Job or JobSet
as read then, and the HorizontalPodAutoscalers of its namespace); where one would, nothing is
done and the outcome ManagedElsewhere says why. Where the operator may not read what it must
check, nothing is done either (NotPermitted). A Kueue Workload is Kueue's own and a Notebook's
stop annotation one that no GitOps tool owns: neither is checked.

Every write carries the object's UID as a precondition where the API takes one, so a pod or
workload recreated under the same name is never acted upon. The rights come only with the
install's policy-actions part; without them the apiserver answers 403 and the outcome says so.
The requests go through the client's object API (`/apis/<group>/<version>/...`) and
kube.core.CoreApi, not the generated AppsV1Api, BatchV1Api and CoreV1Api: importing those
holds much memory (see kube.core).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from kubernetes import client

from gpuusage.api.times import format_time, utc_now
from gpuusage.kube import raw
from gpuusage.kube.core import CoreApi
from gpuusage.kube.errors import Conflict, Forbidden, NotFound, is_other_object, translate
from gpuusage_operator.policies.neighbours import autoscaling, gitops

Outcome = Literal[
    "Done", "Refused", "RateLimited", "NotPermitted", "NotApplicable", "ManagedElsewhere", "Gone"
]


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str


SCALABLE = {"Deployment": "deployments", "StatefulSet": "statefulsets", "ReplicaSet": "replicasets"}


NOTEBOOK_STOPPED = "kubeflow-resource-stopped"
"""The annotation Kubeflow's notebook controller reads to scale a Notebook to zero."""
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_JOB_UID = "kueue.x-k8s.io/job-uid"
KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta1", "workloads")
AUTOSCALERS = ("autoscaling", "v2", "horizontalpodautoscalers")


@dataclass(frozen=True)
class Owner:
    kind: str
    name: str
    uid: str
    api_version: str = ""

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0] if "/" in self.api_version else ""

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


def controller_of(meta: Mapping[str, Any]) -> Owner | None:
    """The object's controlling owner, if any."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return Owner(
                str(ref.get("kind")),
                str(ref.get("name")),
                str(ref.get("uid")),
                str(ref.get("apiVersion") or ""),
            )
    return None


def _read(response: Any) -> dict[str, Any]:
    """The metadata of an object read raw (the client's models cost more than they give)."""
    found = json.loads(raw.body(response)).get("metadata") or {}
    return dict(found)


class Actor:
    """Carries out enforced actions on pods through `api`."""

    def __init__(self, api: client.ApiClient, clock: Callable[[], datetime] = utc_now) -> None:
        self._clock = clock
        self._custom = client.CustomObjectsApi(api)
        self._core = CoreApi(api)

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
        found: Mapping[str, Any] | None = None  # the workload's metadata, once read
        if owner is not None and owner.kind in ("ReplicaSet", "StatefulSet"):
            found = self._read_owner(namespace, owner)
            above = controller_of(found)
            if above is not None and (above.kind, above.group) == ("Deployment", "apps"):
                owner, found = above, None
            elif above is not None and (above.kind, above.group) == ("Notebook", "kubeflow.org"):
                return self._stop_notebook(namespace, above)
            elif above is not None:
                return Result(
                    "ManagedElsewhere",
                    f"{above.kind} {namespace}/{above.name} controls {owner.kind} {owner.name} "
                    "and would scale it back",
                )
        if owner is None or owner.kind not in SCALABLE:
            return Result("NotApplicable", "no Deployment, StatefulSet or ReplicaSet owns the pod")
        where = f"{owner.kind} {namespace}/{owner.name}"
        found = found if found is not None else self._read_owner(namespace, owner)
        if found.get("uid") != owner.uid:
            return Result("Gone", f"{where} is another one now")
        if managed := gitops(found):
            return Result("ManagedElsewhere", f"{where} is managed elsewhere: {managed}")
        try:
            listed: Any = self._custom.list_namespaced_custom_object(
                *AUTOSCALERS[:2], namespace, AUTOSCALERS[2]
            )
        except Exception as exc:
            if not isinstance(translate(exc), Forbidden):
                raise
            return Result(
                "NotPermitted",
                f"the operator may not list HorizontalPodAutoscalers in {namespace}, so it "
                f"cannot tell whether one would scale {where} up again",
            )
        scaling = autoscaling(listed.get("items") or [], owner.kind, owner.name)
        if scaling.undone_by:
            return Result("ManagedElsewhere", f"{where} is managed elsewhere: {scaling.undone_by}")
        body = {"spec": {"replicas": 0}}
        self._custom.patch_namespaced_custom_object_scale(
            "apps", "v1", namespace, SCALABLE[owner.kind], owner.name, body
        )
        paused = ", ".join(scaling.paused)
        after = f" (HorizontalPodAutoscaler {paused} stops scaling it at zero)" if paused else ""
        return Result("Done", f"scaled {where} to zero{after}")

    def _read_owner(self, namespace: str, owner: Owner) -> dict[str, Any]:
        """The metadata of the pod's Deployment, StatefulSet or ReplicaSet."""
        return _read(
            self._custom.get_namespaced_custom_object(
                "apps", "v1", namespace, SCALABLE[owner.kind], owner.name, _preload_content=False
            )
        )

    def _stop_notebook(self, namespace: str, notebook: Owner) -> Result:
        stamp = format_time(self._clock())
        body = {"metadata": {"uid": notebook.uid, "annotations": {NOTEBOOK_STOPPED: stamp}}}
        self._custom.patch_namespaced_custom_object(
            notebook.group, notebook.version, namespace, "notebooks", notebook.name, body
        )
        return Result("Done", f"stopped Notebook {namespace}/{notebook.name} ({NOTEBOOK_STOPPED})")

    def _suspend(self, namespace: str, meta: Mapping[str, Any]) -> Result:
        owner = controller_of(meta)
        if owner is None or owner.kind != "Job":
            return Result("NotApplicable", "no Job owns the pod")
        job = _read(
            self._custom.get_namespaced_custom_object(
                "batch", "v1", namespace, "jobs", owner.name, _preload_content=False
            )
        )
        above = controller_of(job)
        if above is not None and (above.kind, above.group) == ("JobSet", "jobset.x-k8s.io"):
            jobset = _read(
                self._custom.get_namespaced_custom_object(
                    above.group,
                    above.version,
                    namespace,
                    "jobsets",
                    above.name,
                    _preload_content=False,
                )
            )
            if managed := gitops(jobset):
                where = f"JobSet {namespace}/{above.name}"
                return Result("ManagedElsewhere", f"{where} is managed elsewhere: {managed}")
            body = {"metadata": {"uid": above.uid}, "spec": {"suspend": True}}
            self._custom.patch_namespaced_custom_object(
                above.group, above.version, namespace, "jobsets", above.name, body
            )
            return Result("Done", f"suspended JobSet {namespace}/{above.name}")
        if (job.get("labels") or {}).get(KUEUE_QUEUE):
            return self._deactivate_workload(namespace, owner)
        if managed := gitops(job):
            where = f"Job {namespace}/{owner.name}"
            return Result("ManagedElsewhere", f"{where} is managed elsewhere: {managed}")
        self._custom.patch_namespaced_custom_object(
            "batch",
            "v1",
            namespace,
            "jobs",
            owner.name,
            {"metadata": {"uid": owner.uid}, "spec": {"suspend": True}},
        )
        return Result("Done", f"suspended Job {namespace}/{owner.name}")

    def _deactivate_workload(self, namespace: str, job: Owner) -> Result:
        listed: Any = self._custom.list_namespaced_custom_object(
            *KUEUE_WORKLOADS[:2],
            namespace,
            KUEUE_WORKLOADS[2],
            label_selector=f"{KUEUE_JOB_UID}={job.uid}",
        )
        items = list(listed.get("items") or [])
        if len(items) != 1:
            return Result(
                "NotApplicable",
                f"Kueue manages Job {namespace}/{job.name}, and {len(items)} Workloads are its",
            )
        found = items[0]["metadata"]
        body = {"metadata": {"uid": found["uid"]}, "spec": {"active": False}}
        self._custom.patch_namespaced_custom_object(
            *KUEUE_WORKLOADS[:2], namespace, KUEUE_WORKLOADS[2], found["name"], body
        )
        return Result(
            "Done", f"deactivated Kueue Workload {namespace}/{found['name']} of Job {job.name}"
        )

    def _delete(self, namespace: str, name: str, uid: str, meta: Mapping[str, Any]) -> Result:
        owner = controller_of(meta)
        if owner is not None:
            return Result(
                "NotApplicable", f"{owner.kind} {owner.name} owns the pod: it would make another"
            )
        raw.body(
            self._core.delete_namespaced_pod(
                name, namespace, body={"preconditions": {"uid": uid}}, _preload_content=False
            )
        )
        return Result("Done", f"deleted pod {namespace}/{name}")

    def _evict(self, namespace: str, name: str, uid: str) -> Result:
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        raw.body(
            self._core.create_namespaced_pod_eviction(
                name, namespace, eviction, _preload_content=False
            )
        )
        return Result("Done", f"evicted pod {namespace}/{name}")
