"""The models are the source of truth; the CRD in crds/ is rendered from them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gpuusage.api import names
from gpuusage.api.crd import (
    render_crd,
    render_crd_yaml,
    render_policy_crd_yaml,
    to_structural,
)
from gpuusage.api.models import (
    MAX_REQUESTED_GPUS,
    GpuNodeUsage,
    GpuNodeUsageSpec,
    IdlePod,
    PodUsage,
    Process,
)
from gpuusage.api.summary import format_mib
from gpuusage_operator.judge.status import node_totals
from tests.examples import example_spec

REPO = Path(__file__).resolve().parents[1]
CRD_FILE = REPO / "crds" / "gpuusage.io_gpunodeusages.yaml"
NOW = datetime(2026, 11, 21, 17, 0, tzinfo=UTC)


def test_crd_file_matches_the_models() -> None:
    assert CRD_FILE.read_text() == render_crd_yaml(), (
        "crds/ drifted from the models; regenerate with "
        "`gpuusage crd --output crds/gpuusage.io_gpunodeusages.yaml`"
    )
    policies = REPO / "crds" / "gpuusage.io_gpuusagepolicies.yaml"
    assert policies.read_text() == render_policy_crd_yaml(), "regenerate with `make crd`"


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        found += _walk(sub, f"{path}.{name}")
    if "items" in node:
        found += _walk(node["items"], f"{path}[]")
    return found


def test_schema_is_structural_and_bounded() -> None:
    schema = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        assert not {"anyOf", "oneOf", "allOf", "$ref", "title", "default"} & node.keys(), path
        if node["type"] == "array":
            assert "maxItems" in node, f"{path} is an unbounded list"
        if node["type"] == "string" and path.startswith(".spec"):
            bounded = {"maxLength", "pattern", "enum", "format"} & node.keys()
            assert bounded, f"{path} is an unbounded string"


def test_schema_fixes_the_design_paths() -> None:
    spec = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    gpu = spec["properties"]["gpus"]["items"]["properties"]
    process = gpu["processes"]["items"]["properties"]
    assert {"nodeName", "observedAt", "gpus"} <= spec["properties"].keys()
    assert {"index", "uuid", "name", "memory", "processes", "migDevices"} <= gpu.keys()
    assert {"totalMiB", "usedMiB"} <= gpu["memory"]["properties"].keys()
    assert {"pid", "name", "usedMemoryMiB", "containerID", "podUID"} <= process.keys()
    assert process["usedMemoryMiB"]["nullable"] is True
    assert process["containerID"]["pattern"] == "^[0-9a-f]{64}$"
    mig = gpu["migDevices"]["items"]["properties"]
    assert mig["uuid"]["pattern"].startswith("^MIG-")
    assert "processes" in mig


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    status = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "status"
    ]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "reason"}


def test_model_literals_match_the_fixed_names() -> None:
    fields = GpuNodeUsage.model_fields
    assert fields["api_version"].default == names.API_VERSION
    assert fields["kind"].default == names.KIND


def test_crd_names() -> None:
    crd = render_crd()
    assert crd["metadata"]["name"] == "gpunodeusages.gpuusage.io"
    assert crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["shortNames"] == list(names.SHORT_NAMES)
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:6] == ["GPUs", "Pods", "Processes", "Memory", "Stale", "Observed"]


def test_to_structural_rejects_real_unions() -> None:
    with pytest.raises(ValueError, match="union of 2 types"):
        to_structural({"anyOf": [{"type": "string"}, {"type": "integer"}]}, {})


def test_process_validation_names_the_field() -> None:
    with pytest.raises(ValidationError) as caught:
        Process.model_validate({"pid": 12, "containerID": "containerd://" + "a" * 64})
    assert "containerID" in str(caught.value)


def test_models_round_trip_through_the_wire_form() -> None:
    spec = example_spec("n1", NOW)
    wire = spec.to_api()
    assert wire["gpus"][0]["memory"] == {"totalMiB": 81920, "usedMiB": 41472, "reservedMiB": None}
    assert wire["gpus"][0]["processes"][0]["containerID"] == spec.gpus[0].processes[0].container_id
    assert wire["observedAt"] == "2026-11-21T17:00:00Z"
    assert GpuNodeUsageSpec.model_validate(wire) == spec
    assert GpuNodeUsageSpec.model_validate(yaml.safe_load(yaml.safe_dump(wire))) == spec


def test_unknown_fields_from_newer_agents_are_ignored() -> None:
    wire = example_spec("n1", NOW).to_api()
    wire["futureField"] = {"x": 1}
    assert GpuNodeUsageSpec.model_validate(wire) == example_spec("n1", NOW)


def test_totals_count_mig_processes_and_memory() -> None:
    result = node_totals(example_spec("n1", NOW), [], [], idle_pods=0)
    assert result.gpus == 2
    assert result.processes == 4
    assert result.used_memory_mib == 30720 + 10240 + 512 + 20480
    assert result.total_memory_mib == 2 * 81920
    assert result.memory == "60.5Gi/160Gi"


@pytest.mark.parametrize(
    ("mib", "text"), [(0, "0Mi"), (512, "512Mi"), (1024, "1Gi"), (10547, "10.3Gi")]
)
def test_format_mib(mib: int, text: str) -> None:
    assert format_mib(mib) == text


def test_a_requested_gpu_count_beyond_the_bound_is_shown_as_the_bound() -> None:
    """The pod API admits any count; the status shows at most MAX_REQUESTED_GPUS, clamped in
    one place (the model) for every entry that shows it."""
    uid = "11111111-2222-4333-8444-555555555555"
    usage = PodUsage(namespace="ml", name="p", uid=uid, device_uuid="GPU-1", requested_gpus=5000)
    idle = IdlePod(namespace="ml", name="p", uid=uid, requested_gpus=5000, idle_since=NOW)
    assert usage.requested_gpus == idle.requested_gpus == MAX_REQUESTED_GPUS
    assert PodUsage.model_validate(usage.to_api()).requested_gpus == MAX_REQUESTED_GPUS
