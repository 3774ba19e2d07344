"""Render the CustomResourceDefinition from the pydantic models.

pydantic emits JSON Schema (with $ref, anyOf-with-null, titles); the apiserver wants a
*structural* OpenAPI v3 schema (everything inlined, `nullable` instead of a null type, no
titles). The conversion is mechanical and pure, so `crds/` can be checked for drift in a test.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from gpuusage.api import names, policy
from gpuusage.api.models import (
    MAX_ALLOCATED_LISTED,
    MAX_KUBELET_CLAIM_DEVICES,
    MAX_KUBELET_DEVICES,
    MAX_KUBELET_REPLICAS,
    MAX_PROCESSES,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
)

JsonSchema = dict[str, Any]

# Keys the apiserver's structural schema accepts that we pass through unchanged.
_KEEP = {
    "type",
    "format",
    "description",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "required",
    "properties",
    "items",
    "additionalProperties",
    "nullable",
}


INSTALL_LABELS = {"app.kubernetes.io/part-of": "gpuusage"}
"""On every object an install creates (kustomize adds it to the rest, the Helm chart writes it):
the CRDs carry it themselves, so that the chart, which renders its copies of crds/ as they are
(adding only Helm's keep policy), and the kustomize install give the same objects."""


def _resolve(node: JsonSchema, defs: dict[str, JsonSchema]) -> JsonSchema:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


def _bound(value: Any) -> Any:
    """A bound as one number whatever pydantic version rendered it (0.0 and 0 alike)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def to_structural(node: JsonSchema, defs: dict[str, JsonSchema]) -> JsonSchema:
    """Convert one pydantic JSON Schema node into a structural OpenAPI v3 schema node."""
    node = _resolve(node, defs)
    nullable = False
    variants = node.get("anyOf")
    if variants is not None:
        non_null = [v for v in variants if v.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express a union of {len(non_null)} types structurally")
        nullable = len(non_null) < len(variants)
        outer = {k: v for k, v in node.items() if k not in ("anyOf", "default", "title")}
        node = {**_resolve(non_null[0], defs), **outer}
    out: JsonSchema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "properties":
            out[key] = {name: to_structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = to_structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = to_structural(value, defs)
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema's bound; OpenAPI v3.0's (Kubernetes') is the bound and a flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = _bound(value)
            out[key] = True
        elif key in ("minimum", "maximum"):
            out[key] = _bound(value)
        elif key in _KEEP:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if nullable:
        out["nullable"] = True
    if "type" not in out:
        raise ValueError(f"schema node without a type: {node!r}")
    return out


def _schema_of(model: type[BaseModel]) -> JsonSchema:
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    defs = raw.pop("$defs", {})
    return to_structural(raw, defs)


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "GPUs",
        "type": "integer",
        "jsonPath": ".status.totals.gpus",
        "description": "GPUs on the node",
    },
    {
        "name": "Pods",
        "type": "integer",
        "jsonPath": ".status.totals.pods",
        "description": "Pods with processes on the node's GPUs",
    },
    {
        "name": "Processes",
        "type": "integer",
        "jsonPath": ".status.totals.processes",
        "description": "GPU processes on the node",
    },
    {
        "name": "Memory",
        "type": "string",
        "jsonPath": ".status.totals.memory",
        "description": "GPU memory used by processes / total",
    },
    {
        "name": "Stale",
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{names.CONDITION_STALE}")].status',
        "description": "True when the operator saw no sign of life from the agent in time "
        "(a renewal of its Lease, a change of its report)",
    },
    {
        "name": "Observed",
        "type": "date",
        "jsonPath": ".spec.observedAt",
        "description": "When the report's content was observed: a steady node's report is "
        "refreshed only every few minutes (freshness is the Stale column)",
    },
    {
        "name": "Unattributed",
        "type": "integer",
        "jsonPath": ".status.totals.unattributedProcesses",
        "priority": 1,
        "description": "GPU processes that belong to no known pod",
    },
    {
        "name": "Driver",
        "type": "string",
        "jsonPath": ".spec.source.driverVersion",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def render_crd() -> dict[str, Any]:
    """The GpuNodeUsage CRD as a dict, ready for the API or for YAML."""
    spec_schema = _schema_of(GpuNodeUsageSpec)
    spec_schema.setdefault("x-kubernetes-validations", []).extend(
        [
            {
                "rule": "self.gpus.all(g, !has(g.memory) || !has(g.memory.usedMiB) || "
                "g.memory.usedMiB <= g.memory.totalMiB)",
                "message": "gpus[].memory.usedMiB must not exceed gpus[].memory.totalMiB",
            },
            {
                # Per-list bounds multiply; the size of the object needs one on the whole node.
                "rule": "!has(self.gpus) || self.gpus.map(g, "
                "(has(g.processes) ? size(g.processes) : 0) + (has(g.migDevices) ? "
                "g.migDevices.map(m, has(m.processes) ? size(m.processes) : 0).sum() : 0)"
                f").sum() <= {MAX_PROCESSES}",
                "message": f"a report lists at most {MAX_PROCESSES} processes in all "
                "(the agent counts the rest per device as omitted)",
            },
            {
                "rule": "!has(self.kubelet) || !has(self.kubelet.pods) || self.kubelet.pods.map("
                f"p, has(p.devices) ? size(p.devices) : 0).sum() <= {MAX_KUBELET_DEVICES}",
                "message": f"kubelet.pods lists at most {MAX_KUBELET_DEVICES} devices in all",
            },
            {
                "rule": "!has(self.kubelet) || !has(self.kubelet.pods) || self.kubelet.pods.map("
                f"p, has(p.replicas) ? size(p.replicas) : 0).sum() <= {MAX_KUBELET_REPLICAS}",
                "message": f"kubelet.pods lists at most {MAX_KUBELET_REPLICAS} replicas in all",
            },
            {
                "rule": "!has(self.kubelet) || !has(self.kubelet.pods) || self.kubelet.pods.map("
                "p, has(p.claimDevices) ? size(p.claimDevices) : 0).sum() <= "
                f"{MAX_KUBELET_CLAIM_DEVICES}",
                "message": f"kubelet.pods lists at most {MAX_KUBELET_CLAIM_DEVICES} claim devices "
                "in all",
            },
        ]
    )
    status_schema = _schema_of(GpuNodeUsageStatus)
    status_schema.setdefault("x-kubernetes-validations", []).extend(
        [
            {
                "rule": "!has(self.pods) || self.pods.map(p, has(p.containers) ? "
                f"size(p.containers) : 0).sum() <= {MAX_PROCESSES}",
                "message": f"status.pods lists at most {MAX_PROCESSES} container entries in all "
                "(each stands for at least one process of the report)",
            },
            {
                "rule": "!has(self.pods) || self.pods.map(p, has(p.allocatedDevices) ? "
                f"size(p.allocatedDevices) : 0).sum() <= {MAX_ALLOCATED_LISTED}",
                "message": f"status.pods lists at most {MAX_ALLOCATED_LISTED} allocated devices "
                "in all (the rest are counted per entry as omitted)",
            },
        ]
    )
    root = _root(
        "GPU use on one node: what the agent observed (spec) and what the operator made of it "
        "(status). Named after the node.",
        spec_schema,
        status_schema,
    )
    root.update(
        {
            "x-kubernetes-validations": [
                {
                    "rule": "self.metadata.name == self.spec.nodeName",
                    "message": "metadata.name must equal spec.nodeName: "
                    "a GpuNodeUsage is named after its node",
                }
            ],
        }
    )
    return _cluster_crd(
        (names.KIND, names.PLURAL, names.SINGULAR, names.SHORT_NAMES), PRINTER_COLUMNS, root
    )


def _root(description: str, spec: JsonSchema, status: JsonSchema) -> JsonSchema:
    """An object's schema: its spec (required) and status."""
    return {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def _cluster_crd(
    kind: tuple[str, str, str, tuple[str, ...]], columns: list[dict[str, Any]], root: JsonSchema
) -> dict[str, Any]:
    """A cluster-scoped CRD of our group, one version with a status subresource: `kind` is
    (kind, plural, singular, short names)."""
    name, plural, singular, short = kind
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{names.GROUP}", "labels": dict(INSTALL_LABELS)},
        "spec": {
            "group": names.GROUP,
            "scope": "Cluster",
            "names": {
                "kind": name,
                "listKind": f"{name}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short),
                "categories": list(names.CATEGORIES),
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = (
    "# Generated by `gpuusage crd` from gpuusage.api.models; do not edit by hand.\n"
    "# tests/test_models_and_crd.py fails when this file and its source drift apart.\n"
)


def render_crd_yaml() -> str:
    """The CRD as the YAML document stored in crds/."""
    body = yaml.safe_dump(render_crd(), sort_keys=False, width=100)
    return HEADER + "---\n" + body


POLICY_PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Mode",
        "type": "string",
        "jsonPath": ".status.mode",
        "description": "DryRun when no rule enforces, Enforce when every rule does, else Mixed",
    },
    {
        "name": "Rules",
        "type": "string",
        "jsonPath": ".status.rules",
        "description": "finding>action for each rule",
    },
    {
        "name": "Actions",
        "type": "integer",
        "jsonPath": ".status.actionsTaken",
        "description": "Enforced actions carried out",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _one_per_finding(field: str) -> dict[str, str]:
    return {
        "rule": f"!has(self.{field}) || self.{field}.all(r, "
        f"self.{field}.exists_one(s, s.finding == r.finding))",
        "message": f"{field}: at most one rule per finding",
    }


def render_policy_crd() -> dict[str, Any]:
    """The GpuUsagePolicy CRD as a dict, ready for the API or for YAML."""
    spec_schema = _schema_of(policy.GpuUsagePolicySpec)
    spec_schema.setdefault("x-kubernetes-validations", []).extend(
        [
            {
                "rule": "(has(self.rules) ? size(self.rules) : 0) + "
                "(has(self.nodeRules) ? size(self.nodeRules) : 0) >= 1",
                "message": "a policy needs at least one rule in rules or nodeRules",
            },
            _one_per_finding("rules"),
            _one_per_finding("nodeRules"),
        ]
    )
    root = _root(
        "What gpuusage does about what it sees: for the pods a namespace selector and a pod "
        "selector pick, one rule per finding (Notify, or an action, as a dry run unless the rule "
        "says Enforce); and rules for nodes.",
        spec_schema,
        _schema_of(policy.GpuUsagePolicyStatus),
    )
    return _cluster_crd(
        (
            names.POLICY_KIND,
            names.POLICY_PLURAL,
            names.POLICY_SINGULAR,
            names.POLICY_SHORT_NAMES,
        ),
        POLICY_PRINTER_COLUMNS,
        root,
    )


def render_policy_crd_yaml() -> str:
    """The policy CRD as the YAML document stored in crds/."""
    body = yaml.safe_dump(render_policy_crd(), sort_keys=False, width=100)
    return HEADER.replace("gpuusage.api.models", "gpuusage.api.policy") + "---\n" + body
