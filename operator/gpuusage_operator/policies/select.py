"""Which policy covers which pod: its selectors (read as gpuusage.api.selectors reads them), and
the opt-out. Pure.

A selector that is absent selects everything; so does an empty one (`{}`), as with a
NetworkPolicy's podSelector. A namespace carrying `gpuusage.io/exempt: "true"` is covered by no
policy; a pod carrying it by none that allows pods to opt out (`podOptOut: Allowed`, the
default).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuusage.api import names
from gpuusage.api.policy import GpuUsagePolicySpec
from gpuusage.api.selectors import selects


def exempt(annotations: Mapping[str, str] | None) -> bool:
    return (annotations or {}).get(names.ANNOTATION_EXEMPT) == "true"


def opted_out(
    spec: GpuUsagePolicySpec, pod_annotations: Mapping[str, str] | None, namespace_exempt: bool
) -> bool:
    """Whether the policy leaves the pod alone: its namespace opted out, or the pod did and
    the policy lets pods opt themselves out."""
    if namespace_exempt:
        return True
    return spec.pod_opt_out == "Allowed" and exempt(pod_annotations)


def opt_out_hint(spec: GpuUsagePolicySpec) -> str:
    """How the pod's owner may opt out, for the announcement: a policy that ignores the pod's
    own annotation must not tell the owner to write it."""
    if spec.pod_opt_out == "Allowed":
        return f"annotate the pod or its namespace {names.ANNOTATION_EXEMPT}=true to opt out"
    return (
        f"this policy ignores a pod's own {names.ANNOTATION_EXEMPT}; only its namespace's opts out"
    )


def covers(
    spec: GpuUsagePolicySpec,
    namespace_labels: Mapping[str, str],
    pod_labels: Mapping[str, str],
) -> bool:
    """Whether the policy's selectors pick this pod (exemption is asked separately: an exempt
    pod is still covered, so that what the policy would have done can be said)."""
    return selects(spec.namespace_selector, namespace_labels) and selects(
        spec.pod_selector, pod_labels
    )
