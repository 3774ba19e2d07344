"""The pods kept whole (those that may hold GPUs or carry our marks), with the keys lookups find
them under.

Each pod is its PodSnapshot (slotted, frozen) under its UID, and each key
(index.pods.snapshot_keys) holds a tuple of the UIDs under it, not a mapping of its own: at
thousands of GPU nodes these pods were the largest part of the operator's memory when each key
held a dictionary (benchmarks/README.md, "Operator: memory at 5,000 reports"). Unlike the plain
pods (index.podpack), they are not packed: a lookup returns the snapshot as kept, with nothing
to unpack.

Written by the pod watch's thread only, read by any: every write replaces a dict entry whole
(single dict operations, atomic in CPython), and a pod changed is put before what it no
longer is goes, so a reader finds it, as it was or as it is, throughout a change.
"""

from __future__ import annotations

from gpuusage_operator.index.pods import PodSnapshot, snapshot_keys


class KeptPods:
    """UID → snapshot; key (see index.pods.snapshot_keys) → the UIDs under it."""

    def __init__(self) -> None:
        self._pods: dict[str, PodSnapshot] = {}
        self._keys: dict[str, tuple[str, ...]] = {}

    def put(self, ref: PodSnapshot) -> None:
        """Keep a pod (in place of what was kept of it): its snapshot is replaced first, then
        it joins the keys it gained and leaves those it lost, so that it is never missing."""
        old = self._pods.get(ref.uid)
        before = snapshot_keys(old) if old is not None else ()
        after = snapshot_keys(ref)
        self._pods[ref.uid] = ref
        for name in after:
            if name not in before:
                self._keys[name] = (*self._keys.get(name, ()), ref.uid)
        for name in before:
            if name not in after:
                self._leave(name, ref.uid)

    def remove(self, uid: str) -> bool:
        """Forget the pod; whether it was here."""
        ref = self._pods.pop(uid, None)
        if ref is None:
            return False
        for name in snapshot_keys(ref):
            self._leave(name, uid)
        return True

    def _leave(self, name: str, uid: str) -> None:
        rest = tuple(u for u in self._keys.get(name, ()) if u != uid)
        if rest:
            self._keys[name] = rest
        else:
            self._keys.pop(name, None)

    def get(self, uid: str) -> PodSnapshot | None:
        return self._pods.get(uid)

    def under(self, name: str) -> list[PodSnapshot]:
        """The pods found under a key, in the order they were put."""
        found = []
        for uid in self._keys.get(name, ()):
            ref = self._pods.get(uid)
            if ref is not None:
                found.append(ref)
        return found

    def all_keys(self) -> list[str]:
        return list(self._keys)

    def uids(self) -> set[str]:
        return set(self._pods)

    def __len__(self) -> int:
        return len(self._pods)
