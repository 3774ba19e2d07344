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
    MAX_ALLOCATED,
    MAX_ALLOCATED_LISTED,
    MAX_ALLOCATIONS,
    MAX_CONDITIONS,
    MAX_COUNTED,
    MAX_DETAIL,
    MAX_DEVICE_ID,
    MAX_DEVICES,
    MAX_GPUS,
    MAX_IDLE_PODS,
    MAX_KUBELET_CLAIM_DEVICES,
    MAX_KUBELET_DEVICES,
    MAX_KUBELET_PODS,
    MAX_KUBELET_REPLICAS,
    MAX_MIB,
    MAX_MIG_DEVICES,
    MAX_PID,
    MAX_PIDS_LISTED,
    MAX_POD_CLAIM_DEVICES,
    MAX_POD_DEVICES,
    MAX_POD_REPLICATED,
    MAX_PROCESSES,
    MAX_REQUESTED_GPUS,
    MAX_RESOURCE_NAME,
    MAX_SHARE,
    MAX_UNATTRIBUTED,
    Condition,
    ContainerUsage,
    DeviceError,
    DeviceReplicas,
    DeviceUsage,
    Gpu,
    GpuNodeUsage,
    GpuNodeUsageSpec,
    GpuNodeUsageStatus,
    IdlePod,
    KubeletAllocations,
    KubeletClaimDevice,
    KubeletPod,
    Memory,
    MigDevice,
    ObjectMeta,
    PodAllocation,
    PodUsage,
    Process,
    Source,
    Totals,
    UnattributedProcess,
    Utilization,
)
from gpuusage.api.models import GpuNodeUsageStatus as Status
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.freshness import Sighting, freshness
from gpuusage_operator.judge.resolution import resolve_all
from gpuusage_operator.judge.status import desired_status
from tests.builders import snapshots_lookup
from tests.conftest import Kubectl
from tests.examples import (
    CTR_INFER,
    CTR_NOTEBOOK,
    CTR_TRAIN,
    POD_INFER,
    POD_NOTEBOOK,
    POD_TRAIN,
    example_spec,
)

pytestmark = pytest.mark.cluster

OBSERVED = datetime(2026, 11, 21, 17, 0, 0, 123456, tzinfo=UTC)


def example_pods(node: str) -> PodLookup:
    """The example report's pods, running on `node`."""
    return snapshots_lookup(
        *(
            PodSnapshot("ml", name, uid, node, ((cid, "main"),))
            for uid, cid, name in (
                (POD_TRAIN, CTR_TRAIN, "train-0"),
                (POD_NOTEBOOK, CTR_NOTEBOOK, "notebook"),
                (POD_INFER, CTR_INFER, "triton"),
            )
        )
    )


def spec_only_status(spec: GpuNodeUsageSpec, now: datetime) -> Status:
    """The operator's status for the example report, as if its pods existed."""
    resolutions = list(resolve_all(spec, example_pods(spec.node_name)))
    return desired_status(
        spec, resolutions, now, generation=1, fresh=freshness(Sighting(1, now), None, None, now)
    )


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


def test_compact_merge_patches_leave_nothing_behind(custom: client.CustomObjectsApi) -> None:
    """The agent's patches leave out the nulls inside lists (a merge patch replaces lists
    whole), and keep them outside, where a null removes what an earlier write set: reading the
    object back gives exactly the model written last."""
    name = _node_name()
    first = example_spec(name, OBSERVED)
    noisy = first.model_copy(
        update={
            "source": (first.source or Source(kind="fake", available=True)).model_copy(
                update={"message": "NVML is not available"}
            )
        }
    )
    _create(custom, {**_body(name), "spec": noisy.to_patch()})
    patch = first.to_patch()
    assert patch["source"]["message"] is None, "kept: it removes the message written before"
    listed = json.dumps(patch["gpus"])
    assert "null" not in listed
    custom.patch_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL, name, {"spec": patch}
    )
    stored = _get(custom, name)
    assert GpuNodeUsage.model_validate(stored).spec == first
    assert "message" not in stored["spec"]["source"]
    smaller = len(json.dumps(patch, separators=(",", ":")))
    assert smaller < len(json.dumps(first.to_api(), separators=(",", ":")))


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
            lambda s: s.update(gpus=[s["gpus"][0]] * 33),
            "spec.gpus: Too many: 33: must have at most 32 items",
        ),
        (
            lambda s: [
                g.update(processes=[s["gpus"][0]["processes"][0]] * n)
                for g, n in zip(s["gpus"], (257, 256), strict=True)
            ],
            "a report lists at most 512 processes in all",
        ),
        (
            lambda s: s["gpus"][0]["processes"][0].update(name="<script>"),
            "spec.gpus[0].processes[0].name in body should match",
        ),
        (
            lambda s: s.update(
                kubelet={
                    "state": "Read",
                    "pods": [
                        {
                            "namespace": "ml",
                            "name": f"p{k}",
                            "replicas": [{"device": s["gpus"][0]["uuid"], "replicas": 2}]
                            * MAX_POD_REPLICATED,
                        }
                        for k in range(MAX_KUBELET_REPLICAS // MAX_POD_REPLICATED + 1)
                    ],
                }
            ),
            f"kubelet.pods lists at most {MAX_KUBELET_REPLICAS} replicas in all",
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
        "NAME",
        "GPUS",
        "PODS",
        "PROCESSES",
        "MEMORY",
        "STALE",
        "OBSERVED",
        "UNATTRIBUTED",
        "DRIVER",
        "AGE",
    ]
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


ETCD_REQUEST_LIMIT = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)


def _worst_case(name: str) -> GpuNodeUsage:
    """The largest object the schema admits: every list at its bound, every field at its
    longest, spec and status together."""
    safe = "~"  # free text admits printable ASCII only (one byte a character on the wire)
    now = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)
    error = DeviceError(reason="E" * 64, message=safe * MAX_DETAIL)

    def process(pid: int) -> Process:
        return Process(
            pid=MAX_PID - pid,
            name=safe * 64,
            used_memory_mib=MAX_MIB,
            container_id=f"{pid:064x}",
            pod_uid=f"{pid:08x}-0000-4000-8000-000000000000",
            types=["compute", "graphics", "mps"],
            sm_util_percent=100,
            memory_util_percent=100,
            resolve_error=safe * MAX_DETAIL,
            idle_since=now,
        )

    per_gpu = MAX_PROCESSES // MAX_GPUS
    gpus = []
    for g in range(MAX_GPUS):
        uuid = f"GPU-{g:08x}-1111-2222-3333-444444444444"
        migs = [
            MigDevice(
                index=m,
                uuid=f"MIG-{uuid}/{10**4 + m}/{10**4}",
                name=safe * 96,
                gpu_instance_id=2**62,
                compute_instance_id=2**62,
                memory=Memory(total_mib=MAX_MIB, used_mib=MAX_MIB, reserved_mib=MAX_MIB),
                omitted_processes=2**62,
                omitted_memory_mib=MAX_MIB,
                error=error,
            )
            for m in range(MAX_MIG_DEVICES)
        ]
        gpus.append(
            Gpu(
                index=g,
                uuid=uuid,
                name=safe * 96,
                pci_bus_id=safe * 32,
                memory=Memory(total_mib=MAX_MIB, used_mib=MAX_MIB, reserved_mib=MAX_MIB),
                utilization=Utilization(gpu_percent=100, memory_percent=100),
                mig_enabled=True,
                mig_devices=migs,
                error=error,
                processes=[process(g * per_gpu + i) for i in range(per_gpu)],
                omitted_processes=2**62,
                omitted_memory_mib=MAX_MIB,
            )
        )
    long_name = ".".join(["p" * 63] * 4)[:253]
    per_pod = MAX_KUBELET_DEVICES // MAX_KUBELET_PODS
    long_device = f"MIG-GPU-{'a' * 8}-1111-2222-3333-444444444444/{10**4}/{10**4}"
    kubelet = KubeletAllocations(
        state="Unavailable",
        message=safe * 1024,
        pods=[
            KubeletPod(
                namespace="n" * 63,
                name=long_name,
                resources=[f"r{k}" + "x" * (MAX_RESOURCE_NAME - 2) for k in range(4)],
                devices=[long_device[:-3] + f"{d:03d}" for d in range(per_pod)],
                other_devices=MAX_COUNTED,
                replicas=[
                    DeviceReplicas(device=long_device[:-3] + f"{d:03d}", replicas=MAX_COUNTED)
                    for d in range(MAX_POD_REPLICATED)
                ]
                if k < MAX_KUBELET_REPLICAS // MAX_POD_REPLICATED
                else [],
                claim_devices=[
                    KubeletClaimDevice(
                        claim=long_name,
                        driver=("d" * 63),
                        pool=long_name,
                        device="v" * 59 + f"{d:04d}",
                        uuid=long_device,
                    )
                    for d in range(MAX_POD_CLAIM_DEVICES)
                ]
                if k < MAX_KUBELET_CLAIM_DEVICES // MAX_POD_CLAIM_DEVICES
                else [],
                omitted_claim_devices=MAX_COUNTED,
            )
            for k in range(MAX_KUBELET_PODS)
        ],
        dra_message=safe * 1024,
        omitted_pods=MAX_COUNTED,
        replicated=[
            DeviceReplicas(device=long_device[:-3] + f"{d:03d}", replicas=MAX_COUNTED)
            for d in range(MAX_KUBELET_REPLICAS)
        ],
        replicas_message=safe * 1024,
    )
    spec = GpuNodeUsageSpec(
        node_name=name,
        observed_at=now,
        gpus=gpus,
        kubelet=kubelet,
        source=Source(
            kind="nvml",
            available=True,
            message=safe * 1024,
            driver_version=safe * 64,
            cuda_version=safe * 64,
            nvml_version=safe * 64,
            agent_version=safe * 64,
        ),
    )
    device = "D" * MAX_DEVICE_ID

    def condition(kind: str) -> Condition:
        return Condition(
            type=kind,
            status="Unknown",
            observed_generation=2**62,
            last_transition_time=now,
            reason="R" * 128,
            message="<" * 1024,
        )

    allocated_entries = MAX_ALLOCATED_LISTED // MAX_ALLOCATED
    status = GpuNodeUsageStatus(
        observed_generation=2**62,
        report_seen_at=now,
        conditions=[condition(f"Kind{k}") for k in range(MAX_CONDITIONS)],
        totals=Totals(
            gpus=2**62,
            pods=2**62,
            processes=2**62,
            used_memory_mib=MAX_MIB,
            total_memory_mib=MAX_MIB,
            unattributed_processes=2**62,
            unattributed_memory_mib=MAX_MIB,
            unrequested_pods=2**62,
            unallocated_pods=2**62,
            held_idle_pods=2**62,
            idle_pods=2**62,
            blind_devices=MAX_DEVICES,
            memory=safe * 64,
        ),
        devices=[
            DeviceUsage(
                uuid=device,
                index=MAX_GPUS,
                parent_uuid=device,
                total_memory_mib=MAX_MIB,
                used_memory_mib=MAX_MIB,
                processes=MAX_PROCESSES,
                pods=MAX_PROCESSES,
                unattributed_processes=MAX_PROCESSES,
                unattributed_memory_mib=MAX_MIB,
                omitted_processes=2**62,
                omitted_memory_mib=MAX_MIB,
                blind="ProcessesUnresolved",
            )
            for _ in range(MAX_DEVICES)
        ],
        pods=[
            PodUsage(
                namespace="n" * 63,
                name=long_name,
                uid=f"{i:08x}-0000-4000-8000-000000000000",
                device_uuid=device,
                containers=[
                    ContainerUsage(
                        name="c" * 63,
                        pids=[MAX_PID] * MAX_PIDS_LISTED,
                        used_memory_mib=MAX_MIB,
                    )
                ],
                used_memory_mib=MAX_MIB,
                requested_gpus=MAX_REQUESTED_GPUS,
                unrequested=True,
                allocated_by=["DevicePlugin", "DRA", "Fractional"],
                allocated_devices=[device] * MAX_ALLOCATED if i < allocated_entries else [],
                allocated_devices_omitted=MAX_DEVICES,
                unallocated=True,
                held_idle_since=now,
                computing=True,
                compute_share=0.123456789012345,
                handed_share=0.123456789012345,
                handed_memory_mib=MAX_MIB,
            )
            for i in range(MAX_POD_DEVICES)
        ],
        unattributed=[
            UnattributedProcess(
                pid=MAX_PID,
                name=safe * 64,
                device_uuid=device,
                used_memory_mib=MAX_MIB,
                reason="UnknownContainer",
                message=safe * MAX_DETAIL,
            )
            for _ in range(MAX_UNATTRIBUTED)
        ],
        idle_pods=[
            IdlePod(
                namespace="n" * 63,
                name=long_name,
                uid=f"{i:08x}-0000-4000-8000-000000000000",
                requested_gpus=MAX_REQUESTED_GPUS,
                idle_since=now,
            )
            for i in range(MAX_IDLE_PODS)
        ],
        allocations=[
            PodAllocation(
                namespace="n" * 63,
                name=long_name,
                uid=f"{i:08x}-0000-4000-8000-000000000000",
                gpus=MAX_REQUESTED_GPUS,
                mig_devices=MAX_REQUESTED_GPUS,
                gpu_share=MAX_SHARE - 0.123456789,
                gpu_memory_share_mib=MAX_MIB,
            )
            for i in range(MAX_ALLOCATIONS)
        ],
        allocations_omitted=MAX_COUNTED,
    )
    return GpuNodeUsage(metadata=ObjectMeta(name=name), spec=spec, status=status)


def test_the_largest_object_the_schema_admits_is_stored(custom: client.CustomObjectsApi) -> None:
    """Every bound at once, spec and status, as the agent and the operator write them (merge
    patches: `to_patch`): etcd takes it (it refuses requests over 1.5 MiB), so no report they
    may write can freeze a node."""
    name = ".".join(["w" * 63] * 4)[:253]
    worst = _worst_case(name)
    body = worst.to_patch()
    status = body.pop("status")
    _create(custom, body)
    try:
        custom.patch_cluster_custom_object_status(
            names.GROUP, names.VERSION, names.PLURAL, name, {"status": status}
        )
        stored = _get(custom, name)
        size = len(json.dumps(stored, separators=(",", ":")))
        assert stored["status"]["pods"][-1]["uid"] == status["pods"][-1]["uid"]
        assert len(stored["spec"]["gpus"]) == MAX_GPUS
        assert size < ETCD_REQUEST_LIMIT * 0.9, f"{size} bytes: too close to etcd's limit"
    finally:
        custom.delete_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL, name)
