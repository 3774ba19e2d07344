"""The GpuUsagePolicy API: the contract's example is accepted, and a policy that could never
work is refused by the real apiserver at `kubectl apply`, with a message naming the field."""

from __future__ import annotations

import copy
import uuid
from datetime import timedelta
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.api.policy import GpuUsagePolicySpec, parse_duration
from tests.conftest import Kubectl

EXAMPLE: dict[str, Any] = {
    "namespaceSelector": {"matchLabels": {"team": "research"}},
    "podSelector": {"matchLabels": {"app": "notebook"}},
    "rules": [
        {"finding": "HoldingIdleGPU", "after": "30m", "action": "ScaleToZero", "mode": "DryRun"}
    ],
    "nodeRules": [
        {
            "finding": "OrphanedGPUMemory",
            "after": "10m",
            "minMemoryMiB": 1024,
            "action": "Taint",
            "mode": "DryRun",
        }
    ],
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("0s", 0)],
)
def test_durations_read_as_kubectl_writes_them(text: str, expected: int) -> None:
    assert parse_duration(text) == timedelta(seconds=expected)


@pytest.mark.parametrize("text", ["", "30", "30 minutes", "1d", "m", "-5m", "1.5h"])
def test_what_is_no_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_the_contracts_example_reads_with_safe_defaults() -> None:
    spec = GpuUsagePolicySpec.model_validate(EXAMPLE)
    assert spec.rules[0].action == "ScaleToZero"
    bare = GpuUsagePolicySpec.model_validate(
        {"rules": [{"finding": "UsingUnrequestedGPU", "action": "Evict"}]}
    )
    assert bare.rules[0].mode == "DryRun", "nothing is enforced unless a rule says so"


def _policy(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.POLICY_KIND,
        "metadata": {"name": f"p-{uuid.uuid4().hex[:8]}"},
        "spec": spec,
    }


def _create(api: client.ApiClient, spec: dict[str, Any]) -> dict[str, Any]:
    created: Any = client.CustomObjectsApi(api).create_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, _policy(spec)
    )
    return dict(created)


@pytest.mark.cluster
def test_the_example_is_accepted_and_listed_with_its_columns(
    api: client.ApiClient, kubectl: Kubectl
) -> None:
    created = _create(api, EXAMPLE)
    assert created["spec"]["rules"][0]["after"] == "30m"
    shown = kubectl.run("get", "gpuusagepolicy", created["metadata"]["name"])
    assert shown.split()[:5] == ["NAME", "MODE", "RULES", "ACTIONS", "AGE"]
    assert kubectl.run("get", "gup", created["metadata"]["name"], "-o", "name").startswith(
        "gpuusagepolicy.gpuusage.io/"
    )


def _rule(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(EXAMPLE)
    spec["rules"][0].update(changes)
    return spec


def _selector_without_values() -> dict[str, Any]:
    spec = copy.deepcopy(EXAMPLE)
    spec["podSelector"] = {"matchExpressions": [{"key": "app", "operator": "In"}]}
    return spec


def _twice() -> dict[str, Any]:
    spec = copy.deepcopy(EXAMPLE)
    spec["rules"].append({"finding": "HoldingIdleGPU", "action": "Notify"})
    return spec


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (_rule(finding="GpuIdle"), ("spec.rules[0].finding", "Unsupported value")),
        (_rule(action="Evict"), ("HoldingIdleGPU and RequestedGPUsIdle take Notify",)),
        (
            _rule(finding="UsingUnrequestedGPU", action="ScaleToZero"),
            ("UsingUnrequestedGPU and UsingUnallocatedGPU take Notify or Evict",),
        ),
        (_rule(after="30 minutes"), ("spec.rules[0].after",)),
        (_rule(mode="Enforced"), ("spec.rules[0].mode", "Unsupported value")),
        ({"podSelector": {}}, ("a policy needs at least one rule",)),
        (_twice(), ("rules: at most one rule per finding",)),
        (_selector_without_values(), ("values: required for In and NotIn",)),
        ({**EXAMPLE, "podOptOut": "Never"}, ("spec.podOptOut", "Unsupported value")),
    ],
    ids=[
        "unknown finding",
        "eviction for idleness",
        "scaling for misuse",
        "no duration",
        "unknown mode",
        "no rule",
        "two rules for one finding",
        "selector without values",
        "unknown pod opt-out",
    ],
)
def test_a_policy_that_could_never_work_is_refused_naming_the_field(
    api: client.ApiClient, spec: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ApiException) as refused:
        _create(api, spec)
    assert refused.value.status == 422
    for fragment in fragments:
        assert fragment in str(refused.value.body), refused.value.body
