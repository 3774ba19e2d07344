"""The Node condition and taint of the OrphanedGPUMemory rule, read and written. The thin edge
under policies.noderule.

The condition is patched into `nodes/status` (conditions merge by type, so the kubelet's and
other components' conditions are untouched). The taints are a list without a merge key, so a
taint is added or removed by rewriting the list read with its resourceVersion: a write that
raced another (the kubelet, a person's `kubectl taint`) is refused as a conflict and tried
again, never clobbering what the other wrote. The rights (get, list and patch on nodes, patch
on nodes/status) come with the policy-actions part only, and its admission policy lets the
operator change nothing on a Node but this condition and this taint. The list serves `marked`
alone: once a term, the Nodes that carry marks of ours though no report names them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from gpuusage import memory
from gpuusage.api import names
from gpuusage.api.times import format_time
from gpuusage.kube import raw
from gpuusage.kube.core import CoreApi
from gpuusage.kube.errors import Conflict, Forbidden, NotFound, translate
from gpuusage.kube.rest import MERGE_PATCH, STRATEGIC
from gpuusage_operator.policies.act import Result
from gpuusage_operator.policies.noderule import NodeMarks

KEY = names.NODE_CONDITION_ORPHANED
_PAGE = 100
"""Nodes per page of `marked`'s list (a GPU Node's JSON runs to tens of KB): each is parsed and
let go as it is reached, and the memory given back after (see gpuusage.memory)."""


def node_marks(node: dict[str, Any]) -> NodeMarks:
    """Our marks as a Node object (its JSON) carries them."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ours = next((c for c in conditions if c.get("type") == KEY), None)
    taints = (node.get("spec") or {}).get("taints") or []
    return NodeMarks(
        condition=ours is not None and ours.get("status") == "True",
        tainted=any(t.get("key") == KEY for t in taints),
    )


def taints_with(node: dict[str, Any], tainted: bool) -> list[dict[str, Any]]:
    """The node's taints with ours present or absent, every other taint as it was."""
    others = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != KEY]
    if tainted:
        others.append({"key": KEY, "value": "true", "effect": "NoSchedule"})
    return others


class NodeMarker:
    """Reads and writes our marks on Nodes through `api`."""

    def __init__(self, api: client.ApiClient) -> None:
        self._core = CoreApi(api)

    def _read(self, node: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(
            raw.body(self._core.read_node(node, _preload_content=False))
        )
        return found

    def read(self, node: str) -> NodeMarks | Result:
        """The node's marks, or why they cannot be read."""
        try:
            return node_marks(self._read(node))
        except Exception as exc:
            return _failed(exc, "read the node")

    def marked(self) -> set[str] | Result:
        """The Nodes that carry our condition or taint, or why they cannot be listed. Neither
        can be selected on, so every Node is read, a page at a time: the caller does this once
        a term (a report deleted while no replica led leaves its node's marks otherwise)."""
        found: set[str] = set()
        token: str | None = None
        try:
            while True:
                fields: dict[str, Any] = {}
                page = raw.body(
                    self._core.list_node(limit=_PAGE, _continue=token, _preload_content=False)
                )
                for node in raw.list_items(page, fields):
                    if node_marks(node) != NodeMarks():
                        found.add(str((node.get("metadata") or {}).get("name") or ""))
                token = (fields.get("metadata") or {}).get("continue") or None
                if token is None:
                    memory.trim()
                    return found - {""}
        except Exception as exc:  # never raised: a new term's sweep waits for the next pass
            error = translate(exc)
            if isinstance(error, Forbidden):
                return Result("NotPermitted", f"the operator may not list the nodes: {error}")
            return Result("Refused", f"the nodes could not be listed for now: {error}")

    def write(self, node: str, wanted: NodeMarks, message: str, now: datetime) -> Result:
        """Bring the node's marks to `wanted`: the taint first when it goes (the node is
        schedulable again at once), the condition first when it comes (people see why)."""
        try:
            current = self._read(node)
            marks = node_marks(current)
            if wanted.tainted and not marks.tainted:
                if marks.condition != wanted.condition:  # the taint goes on the node it returns
                    current = self._condition(node, wanted.condition, marks.condition, message, now)
                self._taint(node, current, tainted=True)
            else:
                if marks.tainted != wanted.tainted:
                    self._taint(node, current, tainted=wanted.tainted)
                if marks.condition != wanted.condition:
                    self._condition(node, wanted.condition, marks.condition, message, now)
        except Exception as exc:
            return _failed(exc, "mark the node")
        return Result("Done", message)

    def _condition(
        self, node: str, held: bool, was: bool, message: str, now: datetime
    ) -> dict[str, Any]:
        """Write our condition; the Node as the write left it (its new resourceVersion)."""
        stamp = format_time(now.astimezone(UTC))
        condition = {
            "type": KEY,
            "status": "True" if held else "False",
            "reason": "OrphanedGPUMemory" if held else "GPUMemoryFreed",
            "message": message[:1024],
            "lastHeartbeatTime": stamp,
        }
        if held != was:
            condition["lastTransitionTime"] = stamp
        answer = self._core.patch_node_status(
            node,
            {"status": {"conditions": [condition]}},
            _content_type=STRATEGIC,
            _preload_content=False,
        )
        written: dict[str, Any] = json.loads(raw.body(answer))
        return written

    def _taint(self, node: str, current: dict[str, Any], *, tainted: bool) -> None:
        version = (current.get("metadata") or {}).get("resourceVersion")
        body = {
            "metadata": {"resourceVersion": version},
            "spec": {"taints": taints_with(current, tainted)},
        }
        raw.body(
            self._core.patch_node(node, body, _content_type=MERGE_PATCH, _preload_content=False)
        )


def _failed(exc: Exception, what: str) -> Result:
    error = translate(exc)
    if isinstance(error, Forbidden):
        return Result("NotPermitted", f"the operator may not {what}: {error}")
    if isinstance(error, NotFound):
        return Result("Gone", "the node is gone")
    if isinstance(error, Conflict) or error.status == 429:
        return Result("Refused", f"refused for now: {error}")
    raise error from exc
