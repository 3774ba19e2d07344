"""Plain pods packed: exact round trips, what stays whole, and resolution through both forms."""

from __future__ import annotations

from typing import Any

import pytest

from gpuusage.api import names
from gpuusage.api.models import Process
from gpuusage_operator.index.podpack import PlainPods, pack, packable, uid_key, uid_of, unpack
from gpuusage_operator.index.pods import PodSnapshot, snapshot_of
from gpuusage_operator.informers.podwatch import IndexState
from gpuusage_operator.judge.resolution import resolve_process

UID = "0b6c3a52-9d0e-4b8e-8f1a-2c3d4e5f6a7b"
CIDS = ["1" * 64, "2" * 64, "3" * 64]


def body(**extra: Any) -> dict[str, Any]:
    """A running three-container pod; keyword arguments replace or add top-level parts."""
    pod: dict[str, Any] = {
        "metadata": {
            "uid": UID,
            "name": "web-7f9c-abcde",
            "namespace": "team-a",
            "resourceVersion": "123456",
            "labels": {"app": "web"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-25T09:00:00Z"},
        },
        "spec": {"nodeName": "node-1", "containers": [{"name": n} for n in ("a", "b", "c")]},
        "status": {
            "phase": "Running",
            "startTime": "2026-11-25T10:00:00Z",
            "containerStatuses": [
                {"name": n, "containerID": f"containerd://{cid}"}
                for n, cid in zip(("a", "b", "c"), CIDS, strict=True)
            ],
        },
    }
    for key, value in extra.items():
        pod[key] = {**pod.get(key, {}), **value}
    return pod


def snap(pod: dict[str, Any]) -> PodSnapshot:
    ref = snapshot_of(pod)
    assert ref is not None
    return ref


@pytest.mark.parametrize(
    "ref",
    [
        snap(body()),
        PodSnapshot("ns", "pending", UID, None),  # not scheduled: no node, no version
        PodSnapshot(
            "ns",
            "crio",
            UID,
            "n",
            containers=(("not-hex-" + "z" * 60, "x"), ("ABCDEF" * 10 + "abcd", "upper")),
            resource_version="9",
        ),
        PodSnapshot("ns", "p", "not-a-uuid", "n", containers=(("1" * 64, "ünïcode"),)),
        PodSnapshot("ns", "p", UID.upper(), "n"),  # not the canonical form: kept as written
    ],
)
def test_a_packed_pod_unpacks_to_the_same_snapshot(ref: PodSnapshot) -> None:
    key = uid_key(ref.uid)
    assert uid_of(key) == ref.uid
    assert unpack(key, pack(ref)) == ref


def test_the_key_of_a_uuid_is_its_sixteen_bytes_and_never_equals_another_form() -> None:
    assert uid_key(UID) == bytes.fromhex(UID.replace("-", ""))
    assert uid_key("x" * 16) == "x" * 16
    assert uid_key(UID.upper()) != uid_key(UID)


def test_what_is_plain_and_what_stays_whole() -> None:
    plain = body()
    assert packable(snap(plain), plain), "labels of a pod with no GPU and no marks are not kept"
    kept_whole = {
        "GPU request": body(
            spec={
                "nodeName": "node-1",
                "containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            }
        ),
        "our annotation": body(
            metadata={**plain["metadata"], "annotations": {names.ANNOTATION_GPUS: "GPU-1"}}
        ),
        "people's annotation of our group": body(
            metadata={**plain["metadata"], "annotations": {names.ANNOTATION_EXEMPT: "true"}}
        ),
        "our condition": body(
            status={
                **plain["status"],
                "conditions": [{"type": names.POD_CONDITION_GPU_IN_USE, "status": "False"}],
            }
        ),
        "a container's exit to remember": body(
            status={
                **plain["status"],
                "containerStatuses": [
                    {
                        "name": "a",
                        "containerID": f"containerd://{CIDS[0]}",
                        "lastState": {"terminated": {"finishedAt": "2026-11-25T10:01:00Z"}},
                    }
                ],
            }
        ),
        "a GPU resource a DRA driver serves": body(
            spec={
                "nodeName": "node-1",
                "containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            },
            status={
                **plain["status"],
                "extendedResourceClaimStatus": {
                    "resourceClaimName": "web-7f9c-abcde-extended-resources-x2k9z",
                    "requestMappings": [
                        {
                            "containerName": "a",
                            "resourceName": "nvidia.com/gpu",
                            "requestName": "container-0-request-0",
                        }
                    ],
                },
            },
        ),
        "a static pod's mirror": body(
            metadata={**plain["metadata"], "annotations": {"kubernetes.io/config.mirror": "h"}}
        ),
    }
    for why, pod in kept_whole.items():
        assert not packable(snap(pod), pod), why


def process(cid: str | None, uid: str | None) -> Process:
    return Process(pid=42, used_memory_mib=1024, name="python3", container_id=cid, pod_uid=uid)


def test_a_plain_pods_process_resolves_with_its_container_either_way() -> None:
    """By the UID its cgroup names (its container named from the packed status), or, where
    the cgroup names no pod (a kubelet without per-pod cgroups), by a search of the plain pods
    for the container ID; a static pod's container stays a key."""
    state = IndexState()
    state.apply("ADDED", body())
    mirror_uid = "9a9a9a9a-0000-4000-8000-000000000001"
    mirror = body(
        metadata={
            "uid": mirror_uid,
            "name": "etcd-node-1",
            "namespace": "kube-system",
            "annotations": {"kubernetes.io/config.mirror": "hash"},
        },
        status={"containerStatuses": [{"name": "etcd", "containerID": "containerd://" + "9" * 64}]},
    )
    state.apply("ADDED", mirror)
    lookup = state.lookup()
    assert len(state.plain) == 1
    assert lookup.by_container("9" * 64) is not None
    both = resolve_process("node-1", "GPU-0", process(CIDS[1], UID), lookup)
    by_cid = resolve_process("node-1", "GPU-0", process(CIDS[2], None), lookup)
    static = resolve_process("node-1", "GPU-0", process("9" * 64, None), lookup)
    assert (both.pod and both.pod.name, both.container_name) == ("web-7f9c-abcde", "b")
    assert (by_cid.pod and by_cid.pod.name, by_cid.container_name) == ("web-7f9c-abcde", "c")
    assert (static.pod and static.pod.name, static.container_name) == ("etcd-node-1", "etcd")
    elsewhere = resolve_process("node-2", "GPU-0", process(CIDS[0], None), lookup)
    assert elsewhere.reason == "PodOnOtherNode", "a report speaks for its own node alone"
    unknown = resolve_process("node-1", "GPU-0", process("4" * 64, None), lookup)
    assert unknown.reason == "UnknownContainer"


def test_a_search_hit_straddling_two_fields_is_not_taken() -> None:
    """The bytes searched for may occur across a name and the next field's length: only a
    container the record really lists is taken."""
    store = PlainPods()
    ref = PodSnapshot("ns", "p", UID, "n", containers=(("a" * 64, "x"),))
    store.put(ref)
    record = pack(ref)
    assert store.with_container("a" * 64) == ref
    fragment = record[2:8].decode()  # "ns" field and what follows, as a "container ID"
    assert fragment.encode() in record
    assert store.with_container(fragment) is None
