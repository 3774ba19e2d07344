"""The GpuNodeUsage API on the real kube-apiserver: schema, status subresource, columns."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.api import names
from gpuusage.api.models import (
    GpuNodeUsage,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
    ObjectMeta,
)
from gpuusage.api.models import GpuNodeUsageStatus as Status
from gpuusage.examples import (
    CTR_INFER,
    CTR_NOTEBOOK,
    CTR_TRAIN,
    POD_INFER,
    POD_NOTEBOOK,
    POD_TRAIN,
    example_spec,
)
from gpuusage.operator.freshness import Sighting
from gpuusage.operator.podindex import PodLookup, PodRef
from gpuusage.operator.resolution import resolve_all
from gpuusage.operator.status import desired_status
from tests.conftest import Kubectl

pytestmark = pytest.mark.cluster

OBSERVED = datetime(2026, 11, 21, 17, 0, 0, 123456, tzinfo=UTC)


def example_pods(node: str) -> PodLookup:
    """The example report's pods, running on `node`."""
    return PodLookup(
        {
            key: ref
            for uid, cid, name in ((POD_TRAIN, CTR_TRAIN, "train-0"),
                                   (POD_NOTEBOOK, CTR_NOTEBOOK, "notebook"),
                                   (POD_INFER, CTR_INFER, "triton"))
            for ref in [PodRef("ml", name, uid, node, ((cid, "main"),))]
            for key in (f"uid:{uid}", f"cid:{cid}")
        }
    )  # fmt: skip


def spec_only_status(spec: GpuNodeUsageSpec, now: datetime) -> Status:
    """The operator's status for the example report, as if its pods existed."""
    resolutions = list(resolve_all(spec, example_pods(spec.node_name)))
    return desired_status(spec, resolutions, now, generation=1, sighting=Sighting(1, now))


def _node_name() -> str:
    return f"gpu-node-{uuid.uuid4().hex[:8]}"


def _body(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name},
        "spec": example_spec(name, OBSERVED).to_api(),
        **extra,
    }


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def _create(custom: client.CustomObjectsApi, body: dict[str, Any]) -> dict[str, Any]:
    created = custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, body)
    assert isinstance(created, dict)
    return created


def _get(custom: client.CustomObjectsApi, name: str) -> dict[str, Any]:
    got = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, name)
    assert isinstance(got, dict)
    return got


def test_crd_is_established_with_status_subresource(api: client.ApiClient) -> None:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(names.CRD_NAME)
    assert crd.status is not None
    assert crd.status.conditions is not None
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    version = crd.spec.versions[0]
    assert version.subresources is not None
    assert version.subresources.status == {}
    assert crd.spec.scope == "Cluster"
    assert crd.spec.names.short_names == ["gnu"]


def test_create_with_spec_and_read_back_losslessly(custom: client.CustomObjectsApi) -> None:
    name = _node_name()
    _create(custom, _body(name))
    stored = GpuNodeUsage.model_validate(_get(custom, name))
    assert stored.spec == example_spec(name, OBSERVED)
    assert stored.metadata.generation == 1
    # Nulls survive the apiserver (nullable fields are not pruned), so the wire form matches too.
    wire = _get(custom, name)["spec"]
    assert wire == example_spec(name, OBSERVED).to_api()
    assert wire["gpus"][0]["processes"][2]["podUID"] is None


def test_status_round_trip_is_lossless(custom: client.CustomObjectsApi) -> None:
    name = _node_name()
    _create(custom, _body(name))
    status = spec_only_status(example_spec(name, OBSERVED), OBSERVED)
    custom.patch_cluster_custom_object_status(
        names.GROUP, names.VERSION, names.PLURAL, name, {"status": status.to_api()}
    )
    stored = _get(custom, name)
    assert GpuNodeUsageStatus.model_validate(stored["status"]) == status


def test_status_is_ignored_on_the_main_resource(custom: client.CustomObjectsApi) -> None:
    name = _node_name()
    status = spec_only_status(example_spec(name, OBSERVED), OBSERVED).to_api()
    created = _create(custom, _body(name, status=status))
    assert "status" not in created, "status must not be settable through the main resource"

    # A spec writer that sends status along changes spec only.
    custom.patch_cluster_custom_object(
        names.GROUP,
        names.VERSION,
        names.PLURAL,
        name,
        {"spec": {"nodeName": name, "gpus": []}, "status": status},
    )
    after = _get(custom, name)
    assert after["spec"]["gpus"] == []
    assert "status" not in after


def test_status_subresource_does_not_touch_spec(custom: client.CustomObjectsApi) -> None:
    name = _node_name()
    _create(custom, _body(name))
    before = _get(custom, name)
    status = spec_only_status(example_spec(name, OBSERVED), OBSERVED).to_api()
    custom.patch_cluster_custom_object_status(
        names.GROUP,
        names.VERSION,
        names.PLURAL,
        name,
        {"spec": {"gpus": []}, "status": status},
    )
    after = _get(custom, name)
    assert after["spec"] == before["spec"]
    assert after["status"]["totals"]["processes"] == 4
    assert after["metadata"]["generation"] == before["metadata"]["generation"]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda s: s["gpus"][0].update(uuid="GPU-not-a-uuid"),
            "spec.gpus[0].uuid in body should match",
        ),
        (
            lambda s: s["gpus"][0]["processes"][0].update(containerID="containerd://abc"),
            "spec.gpus[0].processes[0].containerID in body should match",
        ),
        (
            lambda s: s["gpus"][0]["processes"][0].update(podUID="not-a-pod-uid"),
            "spec.gpus[0].processes[0].podUID in body should match",
        ),
        (
            lambda s: s["gpus"][0]["processes"][0].update(pid=0),
            "spec.gpus[0].processes[0].pid in body should be greater than or equal to 1",
        ),
        (
            lambda s: s["gpus"][0]["memory"].update(usedMiB=99999),
            "gpus[].memory.usedMiB must not exceed gpus[].memory.totalMiB",
        ),
        (
            lambda s: s.update(nodeName="another-node"),
            "metadata.name must equal spec.nodeName",
        ),
        (
            lambda s: s["gpus"][1]["migDevices"][0].update(uuid="GPU-bad"),
            "spec.gpus[1].migDevices[0].uuid in body should match",
        ),
        (
            lambda s: s.update(gpus=[s["gpus"][0]] * 65),
            "spec.gpus: Too many: 65: must have at most 64 items",
        ),
    ],
)
def test_invalid_objects_are_rejected_with_a_clear_message(
    custom: client.CustomObjectsApi, mutate: Any, expected: str
) -> None:
    name = _node_name()
    body = _body(name)
    mutate(body["spec"])
    with pytest.raises(ApiException) as caught:
        _create(custom, body)
    assert caught.value.status == 422
    message = json.loads(caught.value.body or "{}")["message"]
    assert expected in message


def test_kubectl_get_prints_the_printer_columns(
    custom: client.CustomObjectsApi, kubectl: Kubectl
) -> None:
    name = _node_name()
    _create(custom, _body(name))
    status = spec_only_status(example_spec(name, OBSERVED), OBSERVED)
    custom.patch_cluster_custom_object_status(
        names.GROUP, names.VERSION, names.PLURAL, name, {"status": status.to_api()}
    )
    out = kubectl.run("get", "gpunodeusage", name, "-o", "wide")
    header, row = out.strip().splitlines()
    assert header.split() == [
        "NAME", "GPUS", "PODS", "PROCESSES", "MEMORY", "STALE",
        "OBSERVED", "UNATTRIBUTED", "DRIVER", "AGE",
    ]  # fmt: skip
    cells = row.split()
    assert cells[:6] == [name, "2", "3", "4", "60.5Gi/160Gi", "False"]
    assert cells[7:9] == ["1", "550.54.15"]
    # The short name and the category reach the same objects.
    assert name in kubectl.run("get", "gnu")
    assert name in kubectl.run("get", "gpuusage")


def test_kubectl_explain_uses_model_docs(kubectl: Kubectl) -> None:
    out = kubectl.run("explain", "gpunodeusage.spec.gpus.processes.containerID")
    assert "bare lowercase hex" in out


def test_object_meta_model_reads_api_metadata(custom: client.CustomObjectsApi) -> None:
    name = _node_name()
    created = _create(custom, _body(name))
    meta = ObjectMeta.model_validate(created["metadata"])
    assert meta.name == name
    assert meta.uid
    assert meta.resource_version
