"""The install's objects as the real helm and kubectl kustomize render them, keyed so that the
two can be compared and their objects found: (kind, namespace, name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.conftest import CHART, Helm

NS = "gpuusage-system"

CLUSTER_SCOPED = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "FlowSchema",
    "PriorityLevelConfiguration",
    "SecurityContextConstraints",
}
"""Kinds whose objects have no namespace: kustomize's namespace transformer sets one on those it
does not know (ValidatingAdmissionPolicy*), and the apiserver drops it."""

Key = tuple[str, str, str]


def objects(text: str) -> dict[Key, dict[str, Any]]:
    """Each object of a rendered stream by its key; an object rendered twice fails."""
    out: dict[Key, dict[str, Any]] = {}
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        meta = doc["metadata"]
        if doc["kind"] in CLUSTER_SCOPED:
            meta.pop("namespace", None)
        key = (doc["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = doc
    return out


def set_args(sets: tuple[str, ...]) -> list[str]:
    """`--set` before each value."""
    return [arg for s in sets for arg in ("--set", s)]


def render(
    helm: Helm, *sets: str, namespace: str = NS, chart: Path = CHART
) -> dict[Key, dict[str, Any]]:
    """`helm template` of the chart with these `--set` values, into `namespace`."""
    args = ("-n", namespace, *set_args(sets))
    return objects(helm.run("template", "gpuusage", str(chart), *args).stdout)


def one(found: dict[Key, dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of that kind and name."""
    (only,) = [o for (k, _, n), o in found.items() if (k, n) == (kind, name)]
    return only
