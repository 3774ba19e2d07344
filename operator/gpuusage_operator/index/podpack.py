"""The packed form of a plain pod: one bytes object in place of a PodSnapshot and its keys.

Most pods of a cluster never touch a GPU and never carry our marks, yet the operator watches
them all: a process on a GPU may belong to any pod (use without a request is what it exists to
find). Kept as PodSnapshots under a key per container, such a pod cost about 2.7 kB of heap; a
packed record and a 16-byte UID key cost a few hundred bytes (benchmarks/pod_index_memory.py).

A pod is plain when its snapshot holds nothing beyond who it is, where it runs and its
containers: no request, claim or share, none of our annotations or condition, no labels kept,
no container exits to remember, and it is not a static pod's mirror (a static pod's cgroup
names no API UID, so its container IDs must stay keys; see index.pods). Packing is exact: the
record unpacks to an equal snapshot, so nothing downstream can tell the two forms apart.

Layout: fields each with a two-byte length (0xFFFF: None); a container ID of 64 lowercase hex
digits is stored as its 32 bytes, marked by the length's high bit.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from gpuusage_operator.index.pods import PodSnapshot

UidKey = bytes | str
"""A pod UID as the packed index keys it: its 16 bytes, or the string where it is no UUID."""

_NONE = 0xFFFF
_BINARY = 0x8000
_HEX = frozenset("0123456789abcdef")
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def uid_key(uid: str) -> UidKey:
    """The key of a UID: 16 bytes where it is a UUID in its canonical form (as the apiserver
    writes every pod's), itself otherwise (bytes and strings never compare equal)."""
    try:
        parsed = uuid.UUID(uid)
    except ValueError:
        return uid
    return parsed.bytes if str(parsed) == uid else uid


def uid_of(key: UidKey) -> str:
    return key if isinstance(key, str) else str(uuid.UUID(bytes=key))


def packable(ref: PodSnapshot, body: Mapping[str, Any]) -> bool:
    """Whether the pod is plain (see the module's docstring): its snapshot equals the one its
    record unpacks to."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    if MIRROR_ANNOTATION in annotations:
        return False
    kept = PodSnapshot(
        namespace=ref.namespace,
        name=ref.name,
        uid=ref.uid,
        node=ref.node,
        containers=ref.containers,
        resource_version=ref.resource_version,
        running=ref.running,
        started_at=ref.started_at,
    )
    return kept == ref and all(
        len(value.encode()) < _BINARY
        for value in (ref.namespace, ref.name, ref.node or "", ref.resource_version or "")
    )


def _field(out: bytearray, value: str | None) -> None:
    if value is None:
        out += _NONE.to_bytes(2, "big")
        return
    data = value.encode()
    if len(data) >= _BINARY:
        raise ValueError(f"a field of {len(data)} bytes cannot be packed")
    out += len(data).to_bytes(2, "big") + data


def _container_id(out: bytearray, cid: str) -> None:
    if len(cid) == 64 and _HEX.issuperset(cid):
        out += (_BINARY | 32).to_bytes(2, "big") + bytes.fromhex(cid)
    else:
        _field(out, cid)


def pack(ref: PodSnapshot) -> bytes:
    """The record of a plain pod (packable), its UID aside (the record's key)."""
    out = bytearray()
    for value in (ref.namespace, ref.name, ref.node, ref.resource_version, ref.started_at):
        _field(out, value)
    out.append(1 if ref.running else 0)
    for cid, name in ref.containers:
        _container_id(out, cid)
        _field(out, name)
    return bytes(out)


def _read(record: bytes, at: int) -> tuple[str | None, int]:
    size = int.from_bytes(record[at : at + 2], "big")
    at += 2
    if size == _NONE:
        return None, at
    if size & _BINARY:
        size &= ~_BINARY
        return record[at : at + size].hex(), at + size
    return record[at : at + size].decode(), at + size


def unpack(key: UidKey, record: bytes) -> PodSnapshot:
    """The snapshot a record was packed from."""
    fields: list[str | None] = []
    at = 0
    for _ in range(5):
        value, at = _read(record, at)
        fields.append(value)
    running = record[at] == 1
    at += 1
    containers: list[tuple[str, str]] = []
    while at < len(record):
        cid, at = _read(record, at)
        name, at = _read(record, at)
        containers.append((cid or "", name or ""))
    namespace, name, node, version, started = fields
    return PodSnapshot(
        namespace=namespace or "",
        name=name or "",
        uid=uid_of(key),
        node=node,
        containers=tuple(containers),
        resource_version=version,
        running=running,
        started_at=started,
    )


def holds_container(record: bytes, container_id: str) -> bool:
    """Whether the record lists this container ID (a quick test before unpacking: the
    bytes searched for could in theory straddle two fields, so a hit is confirmed)."""
    if len(container_id) == 64 and _HEX.issuperset(container_id):
        needle = (_BINARY | 32).to_bytes(2, "big") + bytes.fromhex(container_id)
    else:
        needle = container_id.encode()
    return needle in record


class PlainPods:
    """The plain pods, by UID key: written by the pod watch's thread only, read by any
    (single dict operations, atomic in CPython; a scan reads a copy of the values)."""

    def __init__(self) -> None:
        self._records: dict[UidKey, bytes] = {}

    def put(self, ref: PodSnapshot) -> None:
        self._records[uid_key(ref.uid)] = pack(ref)

    def remove(self, uid: str) -> bool:
        """Forget the pod; whether it was here."""
        return self._records.pop(uid_key(uid), None) is not None

    def get(self, uid: str) -> PodSnapshot | None:
        key = uid_key(uid)
        record = self._records.get(key)
        return None if record is None else unpack(key, record)

    def with_container(self, container_id: str) -> PodSnapshot | None:
        """The pod whose status lists this container ID: a scan, for the processes whose
        cgroup names a container but no pod UID (static pods are not kept here; a kubelet
        without per-pod cgroups; a container outside Kubernetes, which no pod lists)."""
        for key, record in list(self._records.items()):
            if holds_container(record, container_id):
                pod = unpack(key, record)
                if pod.container_name(container_id) is not None:
                    return pod
        return None

    def uids(self) -> set[str]:
        return {uid_of(key) for key in list(self._records)}

    def __len__(self) -> int:
        return len(self._records)
