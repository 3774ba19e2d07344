"""The pods kept whole: kept as put, and the keys they are found under as they change, move and
go."""

from __future__ import annotations

from gpuusage.api import names
from gpuusage_operator.index.keptpods import KeptPods
from gpuusage_operator.index.podpack import PlainPods
from gpuusage_operator.index.pods import PodLookup, PodSnapshot

UID_A = "0b6c3a52-9d0e-4b8e-8f1a-2c3d4e5f6a7b"
UID_B = "1b6c3a52-9d0e-4b8e-8f1a-2c3d4e5f6a7b"
CONDITION = (
    ("lastTransitionTime", "2026-11-27T10:00:00Z"),
    ("message", "1 GPU, 40 % of its compute"),
    ("reason", "ProcessesRunning"),
    ("status", "True"),
    ("type", names.POD_CONDITION_GPU_IN_USE),
)


def gpu_pod(uid: str = UID_A, node: str | None = "n1", **changes: object) -> PodSnapshot:
    fields: dict[str, object] = {
        "namespace": "ml",
        "name": "train-0",
        "uid": uid,
        "node": node,
        "containers": (("a" * 64, "main"), ("b" * 64, "init")),
        "annotations": ((names.ANNOTATION_GPUS, "GPU-1"),),
        "condition": CONDITION,
        "resource_version": "42",
        "gpu_requests": 2,
        "gpu_resources": ("nvidia.com/gpu",),
        "mig_requests": 0,
        "fraction": "",
        "claims": ("gpu-claim",),
        "pending_claims": 1,
        "extended_claim": "train-0-gpu-8x2kq",
        "extended_requests": ("container-0-request-0",),
        "running": True,
        "started_at": "2026-11-27T09:00:00Z",
        "labels": (("app", "train"),),
        "exits": (("main", "2026-11-27T09:30:00Z"),),
    }
    fields.update(changes)
    return PodSnapshot(**fields)  # type: ignore[arg-type]


def test_a_pod_is_kept_as_put_and_replaced_whole() -> None:
    kept = KeptPods()
    for ref in (
        gpu_pod(),
        gpu_pod(node=None, resource_version=None, started_at=None, condition=()),
        gpu_pod(name="ünïcode-名前", fraction="gpu-fraction=0.5", running=False),
    ):
        kept.put(ref)
        assert kept.get(UID_A) is ref
        assert kept.under("cid:" + "a" * 64) == [ref]
    assert len(kept) == 1


def test_a_pod_is_found_under_its_keys_until_it_changes_or_goes() -> None:
    kept = KeptPods()
    kept.put(gpu_pod())
    kept.put(gpu_pod(UID_B, containers=(("c" * 64, "main"),), annotations=(), condition=()))
    lookup = PodLookup(kept)
    assert lookup.by_uid(UID_A) == gpu_pod()
    found = lookup.by_container("b" * 64)
    assert found is not None
    assert found.uid == UID_A
    assert {ref.uid for ref in lookup.requesting_on_node("n1")} == {UID_A, UID_B}
    assert [ref.uid for ref in lookup.on_node_with_our_marks("n1")] == [UID_A]
    assert lookup.nodes_with_our_marks() == {"n1"}

    # Moved (a new snapshot with another node and container): the old keys hold it no more.
    kept.put(gpu_pod(node="n2", containers=(("d" * 64, "main"),)))
    assert lookup.by_container("a" * 64) is None
    found = lookup.by_container("d" * 64)
    assert found is not None
    assert found.node == "n2"
    assert [ref.uid for ref in lookup.requesting_on_node("n1")] == [UID_B]
    assert lookup.nodes_with_our_marks() == {"n2"}
    assert len(kept) == 2

    assert kept.remove(UID_A) is True
    assert kept.remove(UID_A) is False, "gone already"
    assert lookup.by_uid(UID_A) is None
    assert lookup.nodes_with_our_marks() == set()
    assert sorted(kept.all_keys()) == [
        "cid:" + "c" * 64,
        "claim:ml/gpu-claim",
        "claim:ml/train-0-gpu-8x2kq",
        "requesting:n1",
    ]
    assert kept.uids() == {UID_B}


def test_a_container_id_two_pods_claim_finds_the_last_put_and_then_the_other() -> None:
    kept = KeptPods()
    kept.put(gpu_pod(UID_A, containers=(("e" * 64, "main"),)))
    kept.put(gpu_pod(UID_B, containers=(("e" * 64, "main"),)))
    lookup = PodLookup(kept)
    found = lookup.by_container("e" * 64)
    assert found is not None
    assert found.uid == UID_B
    kept.remove(UID_B)
    found = lookup.by_container("e" * 64)
    assert found is not None
    assert found.uid == UID_A


def test_a_lookup_made_while_the_index_is_empty_sees_pods_put_afterwards() -> None:
    """A lookup reads the index as it is when asked, not as it was when the lookup was made
    (an empty index is no missing index)."""
    kept, plain = KeptPods(), PlainPods()
    lookup = PodLookup(kept, plain)
    kept.put(gpu_pod())
    plain.put(PodSnapshot("ml", "web", UID_B, "n1", (("f" * 64, "main"),)))
    found = lookup.by_container("a" * 64)
    assert found is not None
    assert found.uid == UID_A
    assert lookup.nodes_with_our_marks() == {"n1"}
    web = lookup.plain_with_container("f" * 64)
    assert web is not None
    assert web.name == "web"
