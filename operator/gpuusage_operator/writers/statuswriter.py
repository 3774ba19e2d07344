"""Writing a report's status: only what changed, on condition that the report is still the
version it was read at, and knowing which watch event is the echo of that write."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gpuusage.api import names
from gpuusage.kube import raw
from gpuusage.kube.errors import Conflict, retried
from gpuusage.kube.mergepatch import merge_diff


class StatusCounts(Protocol):
    status_writes: int
    status_conflicts: int

    def add(self, name: str, n: int = 1) -> None:
        """Count `n` more of `name` (safe from any thread)."""


def write_status(
    custom: Any,
    counts: StatusCounts,
    *,
    name: str,
    meta: Mapping[str, Any],
    known: dict[str, Any] | None,
    wanted: dict[str, Any],
) -> bytes:
    """Write the status; what the write returned.

    Only what changed is sent, on condition that the report is still the version it was
    read at (its resourceVersion in the patch: the apiserver refuses the write with 409
    when anyone wrote since, because then what changed is not known). On that refusal, or
    without a status to compare with, the whole status is sent.
    """

    def send(patch: dict[str, Any]) -> bytes:
        data = retried(
            lambda: raw.body(
                custom.patch_cluster_custom_object_status(
                    names.GROUP,
                    names.VERSION,
                    names.PLURAL,
                    name,
                    patch,
                    _preload_content=False,
                )
            ),
            f"status of {name}",
        )
        counts.add("status_writes")
        return data

    version = meta.get("resourceVersion")
    if known is not None and version:
        change = {"metadata": {"resourceVersion": version}, "status": merge_diff(known, wanted)}
        try:
            return send(change)
        except Conflict:
            counts.add("status_conflicts")
    return send({"status": wanted})


def echo_version(response: bytes, generation: int | None) -> str | None:
    """The resourceVersion our status write produced, if that version shows the spec we
    reconciled: an agent write that landed between our read and our write raised the
    generation, and then the event of that version must be reconciled, not skipped."""
    meta = raw.written_metadata(response)
    version = meta.get("resourceVersion")
    if not isinstance(version, str) or generation is None or meta.get("generation") != generation:
        return None
    return version
