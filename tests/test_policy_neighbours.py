"""Whether a GitOps tool or an autoscaler would undo a policy's ScaleToZero or Suspend
(policies.neighbours). Pure; the Actor acting on it, under the operator's token on the real
apiserver, is in test_policy_rights_on_cluster and the decisions it leads to in
test_policies_on_cluster."""

from __future__ import annotations

from typing import Any

import pytest

from gpuusage_operator.policies.neighbours import Autoscaling, autoscaling, gitops

HELM = {"meta.helm.sh/release-name": "serve", "meta.helm.sh/release-namespace": "ml"}


def meta(labels: dict[str, str] | None = None, /, **annotations: str) -> dict[str, Any]:
    return {"name": "web", "labels": labels or {}, "annotations": annotations}


@pytest.mark.parametrize(
    ("found", "who"),
    [
        (meta(), ""),
        (meta({"app": "web"}, note="x"), ""),
        ({"name": "web"}, ""),  # no labels, no annotations at all
        (
            meta(**{"argocd.argoproj.io/tracking-id": "shop:apps/Deployment:ml/web"}),
            "Argo CD tracks it (annotation argocd.argoproj.io/tracking-id)",
        ),
        (
            meta({"app.kubernetes.io/instance": "shop"}),
            "Argo CD tracks it (label app.kubernetes.io/instance=shop)",
        ),
        (
            meta({"argocd.argoproj.io/instance": "shop"}),
            "Argo CD tracks it (label argocd.argoproj.io/instance=shop)",
        ),
        # Helm's own release annotation naming the same release: Helm's label, not Argo CD's.
        (meta({"app.kubernetes.io/instance": "serve"}, **HELM), ""),
        (
            meta({"app.kubernetes.io/instance": "shop"}, **HELM),
            "Argo CD tracks it (label app.kubernetes.io/instance=shop)",
        ),
        (
            meta(
                {"app.kubernetes.io/instance": "serve"},
                **HELM,
                **{"argocd.argoproj.io/tracking-id": "serve:apps/Deployment:ml/web"},
            ),
            "Argo CD tracks it (annotation argocd.argoproj.io/tracking-id)",
        ),
        (
            meta(
                {
                    "kustomize.toolkit.fluxcd.io/name": "apps",
                    "kustomize.toolkit.fluxcd.io/namespace": "flux-system",
                }
            ),
            "Flux's Kustomization flux-system/apps applies it",
        ),
        (
            meta({"kustomize.toolkit.fluxcd.io/name": "apps"}),
            "Flux's Kustomization apps applies it",
        ),
        (
            meta(
                {"kustomize.toolkit.fluxcd.io/name": "apps"},
                **{"kustomize.toolkit.fluxcd.io/reconcile": "disabled"},
            ),
            "",
        ),
        (
            meta(
                {
                    "helm.toolkit.fluxcd.io/name": "serve",
                    "helm.toolkit.fluxcd.io/namespace": "flux-system",
                    "app.kubernetes.io/instance": "serve",
                },
                **HELM,
            ),
            "Flux's HelmRelease flux-system/serve applies it",
        ),
        # Flux's switch is kustomize-controller's: helm-controller does not read it.
        (
            meta(
                {"helm.toolkit.fluxcd.io/name": "serve"},
                **{"kustomize.toolkit.fluxcd.io/reconcile": "disabled"},
            ),
            "Flux's HelmRelease serve applies it",
        ),
        (meta({"kustomize.toolkit.fluxcd.io/name": ""}), ""),
    ],
)
def test_a_workload_a_gitops_tool_keeps_is_named_with_how_it_shows(
    found: dict[str, Any], who: str
) -> None:
    assert gitops(found) == (f"{who} and would undo it" if who else "")


def hpa(
    name: str,
    target: tuple[str, str] = ("Deployment", "web"),
    least: int | None = None,
    labels: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": target[0], "name": target[1]},
        "maxReplicas": 4,
    }
    if least is not None:
        spec["minReplicas"] = least
    meta = {"name": name, "labels": labels or {}, "ownerReferences": owners or []}
    return {"metadata": meta, "spec": spec}


SCALED_OBJECT = {
    "apiVersion": "keda.sh/v1alpha1",
    "kind": "ScaledObject",
    "name": "web-queue",
    "uid": "u",
    "controller": True,
}
KEDA = "KEDA's ScaledObject {} scales it (HorizontalPodAutoscaler {}) and would scale it up again"


@pytest.mark.parametrize(
    ("listed", "expected"),
    [
        ([], Autoscaling()),
        ([hpa("web")], Autoscaling(paused=("web",))),
        ([hpa("web", least=2)], Autoscaling(paused=("web",))),
        # another workload's, another kind's of that name
        ([hpa("api", ("Deployment", "api")), hpa("sts", ("StatefulSet", "web"))], Autoscaling()),
        (
            [hpa("web", least=0)],
            Autoscaling(
                "HorizontalPodAutoscaler web scales it from minReplicas 0 and would scale it up "
                "again"
            ),
        ),
        (
            [hpa("anything", least=1, owners=[SCALED_OBJECT])],
            Autoscaling(KEDA.format("web-queue", "anything")),
        ),
        (
            [hpa("hpa-web", labels={"app.kubernetes.io/managed-by": "keda-operator"})],
            Autoscaling(KEDA.format("hpa-web", "hpa-web")),
        ),
        (
            [
                hpa(
                    "custom",
                    labels={
                        "app.kubernetes.io/managed-by": "keda-operator",
                        "app.kubernetes.io/part-of": "web-queue",
                    },
                )
            ],
            Autoscaling(KEDA.format("web-queue", "custom")),
        ),
        ([hpa("keda-hpa-web-queue")], Autoscaling(KEDA.format("web-queue", "keda-hpa-web-queue"))),
        # One that would undo it is enough, whatever the others do.
        (
            [hpa("web"), hpa("keda-hpa-q")],
            Autoscaling(KEDA.format("q", "keda-hpa-q"), paused=("web",)),
        ),
        # Another group's ScaledObject is not KEDA's.
        (
            [hpa("web", owners=[{**SCALED_OBJECT, "apiVersion": "example.com/v1"}])],
            Autoscaling(paused=("web",)),
        ),
    ],
)
def test_an_autoscaler_undoes_a_scale_to_zero_only_from_keda_or_min_replicas_zero(
    listed: list[dict[str, Any]], expected: Autoscaling
) -> None:
    """The HPA controller stops scaling a target with no replicas when its minReplicas is 1 or
    more (the default): those are named, as they pause; KEDA's and one allowed to scale to
    zero would bring the workload back."""
    assert autoscaling(listed, "Deployment", "web") == expected
