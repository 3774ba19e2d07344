"""The pods kept whole (those that may hold GPUs or carry our marks), each packed into one bytes
object, with the keys lookups find them under.

At thousands of GPU nodes with a pod each, these pods were the largest part of the operator's
memory: each a PodSnapshot object with its tuples and strings, filed under four keys that each
held a mapping of its own (benchmarks/README.md, "Operator: memory at 5,000 reports"). Here a
pod is its snapshot's fields as one `marshal` record (its UID is the record's key, as
index.podpack keys it), and each key (index.pods.snapshot_keys) holds a tuple of the UID keys
under it. A lookup unpacks the pods it returns; packing is exact, so the snapshot read back
equals the one put.

Written by the pod watch's thread only, read by any: every write replaces a dict entry whole
(single dict operations, atomic in CPython), and a pod changed is put before what it no
longer is goes, so a reader finds it, as it was or as it is, throughout a change.
"""

from __future__ import annotations

import marshal
from dataclasses import fields

from gpuusage_operator.index.podpack import UidKey, uid_key, uid_of
from gpuusage_operator.index.pods import PodSnapshot, snapshot_keys

_PACKED = tuple(f.name for f in fields(PodSnapshot) if f.name != "uid")
"""The fields a record holds, in this order: all but the UID (the record's key)."""


def pack_whole(ref: PodSnapshot) -> bytes:
    """The record of a snapshot, its UID aside (the record's key)."""
    return marshal.dumps(tuple(getattr(ref, name) for name in _PACKED))


def unpack_whole(key: UidKey, record: bytes) -> PodSnapshot:
    """The snapshot a record was packed from."""
    return PodSnapshot(uid=uid_of(key), **dict(zip(_PACKED, marshal.loads(record), strict=True)))


class KeptPods:
    """UID key → packed snapshot; key (see index.pods.snapshot_keys) → the UID keys under it."""

    def __init__(self) -> None:
        self._records: dict[UidKey, bytes] = {}
        self._keys: dict[str, tuple[UidKey, ...]] = {}

    def put(self, ref: PodSnapshot) -> None:
        """Keep a pod (in place of what was kept of it): its record is replaced first, then
        it joins the keys it gained and leaves those it lost, so that it is never missing."""
        key = uid_key(ref.uid)
        old = self._records.get(key)
        before = snapshot_keys(unpack_whole(key, old)) if old is not None else ()
        after = snapshot_keys(ref)
        self._records[key] = pack_whole(ref)
        for name in after:
            if name not in before:
                self._keys[name] = (*self._keys.get(name, ()), key)
        for name in before:
            if name not in after:
                self._leave(name, key)

    def remove(self, uid: str) -> bool:
        """Forget the pod; whether it was here."""
        key = uid_key(uid)
        record = self._records.pop(key, None)
        if record is None:
            return False
        for name in snapshot_keys(unpack_whole(key, record)):
            self._leave(name, key)
        return True

    def _leave(self, name: str, key: UidKey) -> None:
        rest = tuple(k for k in self._keys.get(name, ()) if k != key)
        if rest:
            self._keys[name] = rest
        else:
            self._keys.pop(name, None)

    def get(self, uid: str) -> PodSnapshot | None:
        key = uid_key(uid)
        record = self._records.get(key)
        return None if record is None else unpack_whole(key, record)

    def under(self, name: str) -> list[PodSnapshot]:
        """The pods found under a key, in the order they were put."""
        found = []
        for key in self._keys.get(name, ()):
            record = self._records.get(key)
            if record is not None:
                found.append(unpack_whole(key, record))
        return found

    def all_keys(self) -> list[str]:
        return list(self._keys)

    def uids(self) -> set[str]:
        return {uid_of(key) for key in list(self._records)}

    def __len__(self) -> int:
        return len(self._records)
