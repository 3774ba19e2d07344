"""Who else keeps a workload as it sees fit, and would undo a policy's action on it. Pure.

A ScaleToZero or Suspend that another controller undoes is worse than none: the pod comes
back, its finding with it, and the operator and that controller take turns on the workload.
The Actor (see policies.act) asks here before it writes; where a neighbour would undo the
change, it does nothing and says why (outcome ManagedElsewhere).

* **GitOps.** Argo CD marks what it manages with the annotation
  `argocd.argoproj.io/tracking-id` (its default since 3.0) or the label
  `app.kubernetes.io/instance` (before, and with `annotation+label`; some installs name the
  label `argocd.argoproj.io/instance` instead). Flux's kustomize-controller labels what it
  applies `kustomize.toolkit.fluxcd.io/name` and `/namespace`, its helm-controller
  `helm.toolkit.fluxcd.io/name` and `/namespace`. Each puts the object back as its source says:
  Argo CD with self-heal at once, and without it at its next sync (automated on every commit,
  or by hand), so an Application's `selfHeal: false` does not make a change stick either; the
  operator reads no Application. A tracked object is left alone, but where the tool itself
  says it leaves the object be: Flux's `kustomize.toolkit.fluxcd.io/reconcile: disabled`. Helm
  charts set `app.kubernetes.io/instance` to their release's name too, and Helm undoes
  nothing: that label names no Argo CD Application where the object carries Helm's own
  `meta.helm.sh/release-name` annotation with the same name (written by `helm install`, not by
  Argo CD, which renders a chart with `helm template`).
* **Autoscalers.** A HorizontalPodAutoscaler stops scaling a target that has no replicas when
  its minReplicas is 1 or more (the default; its condition ScalingActive turns False,
  ScalingDisabled) until someone scales the target up again: a scale to zero sticks, and the
  owner's scale-up resumes autoscaling. One with minReplicas 0 (the HPAScaleToZero feature
  gate) scales the target up again when its metrics call for it, and KEDA (whose ScaledObject
  owns the autoscaler it makes, `keda-hpa-<name>`, labelled managed by keda-operator) brings a
  workload back from zero itself: either would undo it. The autoscaler's target is matched by
  kind and name.

The names of the labels and annotations are each tool's documented ones; a tool configured to
track by another label is not seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ARGO_TRACKING_ID = "argocd.argoproj.io/tracking-id"
"""Argo CD's tracking annotation: `<app>:<group>/<kind>:<namespace>/<name>`."""
ARGO_LABELS = ("app.kubernetes.io/instance", "argocd.argoproj.io/instance")
"""Argo CD's tracking label (the Application's name), by default and as commonly configured."""
HELM_RELEASE = "meta.helm.sh/release-name"
"""The annotation `helm install` writes on every object of a release."""
KUSTOMIZE = "kustomize.toolkit.fluxcd.io"
FLUX = (
    (KUSTOMIZE, "Kustomization"),
    ("helm.toolkit.fluxcd.io", "HelmRelease"),
)
"""Flux's label prefixes (`<prefix>/name`, `<prefix>/namespace`) and what each names."""
FLUX_RECONCILE = "kustomize.toolkit.fluxcd.io/reconcile"
"""`disabled`: Flux's kustomize-controller neither applies nor prunes the object."""
KEDA_GROUP = "keda.sh"
KEDA_MANAGER = "keda-operator"
KEDA_PREFIX = "keda-hpa-"


def gitops(meta: Mapping[str, Any]) -> str:
    """Which GitOps tool would put the object (its metadata) back as its source says, and how
    that shows ("" none would)."""
    labels: Mapping[str, str] = meta.get("labels") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    for prefix, kind in FLUX:
        name = labels.get(f"{prefix}/name")
        if not name:
            continue
        if prefix == KUSTOMIZE and annotations.get(FLUX_RECONCILE) == "disabled":
            continue
        where = labels.get(f"{prefix}/namespace")
        return f"Flux's {kind} {where + '/' if where else ''}{name} applies it and would undo it"
    if annotations.get(ARGO_TRACKING_ID):
        return f"Argo CD tracks it (annotation {ARGO_TRACKING_ID}) and would undo it"
    for key in ARGO_LABELS:
        app = labels.get(key)
        if not app or (key == ARGO_LABELS[0] and annotations.get(HELM_RELEASE) == app):
            continue
        return f"Argo CD tracks it (label {key}={app}) and would undo it"
    return ""


@dataclass(frozen=True)
class Autoscaling:
    """What the autoscalers of a workload would make of a scale to zero."""

    undone_by: str = ""
    """Why one would scale it up again ("" none would)."""
    paused: tuple[str, ...] = ()
    """The HorizontalPodAutoscalers that stop scaling it while it has no replicas."""


def autoscaling(hpas: Iterable[Mapping[str, Any]], kind: str, name: str) -> Autoscaling:
    """What the HorizontalPodAutoscalers of the workload's namespace (as listed) would make of
    its scale to zero."""
    undone: list[str] = []
    paused: list[str] = []
    for hpa in hpas:
        spec: Mapping[str, Any] = hpa.get("spec") or {}
        target: Mapping[str, Any] = spec.get("scaleTargetRef") or {}
        if (target.get("kind"), target.get("name")) != (kind, name):
            continue
        meta: Mapping[str, Any] = hpa.get("metadata") or {}
        called = str(meta.get("name") or "")
        scaled_object = _keda(meta)
        least = spec.get("minReplicas")
        if scaled_object:
            undone.append(
                f"KEDA's ScaledObject {scaled_object} scales it (HorizontalPodAutoscaler "
                f"{called}) and would scale it up again"
            )
        elif least is not None and least < 1:
            undone.append(
                f"HorizontalPodAutoscaler {called} scales it from minReplicas 0 and would "
                "scale it up again"
            )
        else:
            paused.append(called)
    return Autoscaling("; ".join(undone), tuple(paused))


def _keda(meta: Mapping[str, Any]) -> str:
    """The ScaledObject that made the autoscaler, if KEDA did ("" otherwise)."""
    for ref in meta.get("ownerReferences") or []:
        group = str(ref.get("apiVersion") or "").rpartition("/")[0]
        if (ref.get("kind"), group) == ("ScaledObject", KEDA_GROUP):
            return str(ref.get("name") or "")
    labels: Mapping[str, str] = meta.get("labels") or {}
    name = str(meta.get("name") or "")
    if labels.get("app.kubernetes.io/managed-by") == KEDA_MANAGER or name.startswith(KEDA_PREFIX):
        return labels.get("app.kubernetes.io/part-of") or name.removeprefix(KEDA_PREFIX)
    return ""
