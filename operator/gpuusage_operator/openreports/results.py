"""The findings as OpenReports: one Report per namespace for its pods, one ClusterReport for the
nodes. Pure.

Policy tools (Kyverno, Kubewarden, Falco, Trivy) write their findings as `openreports.io`
reports, and Policy Reporter turns those into metrics, dashboards and alerts; gpuusage's
findings belong there too. Nothing here decides a finding: a pod's comes from its GPUInUse
condition (see judge.findings), a node's from what its report's status says, and a policy
that covers one from the announcement it left on the pod or from its node rule.

A report is built only from facts that stay put while a finding holds (never memory figures,
which change at every report), so that a steady cluster asks for no write; a result keeps the
time it was first published (`timestamp`) unless the finding's own start is known.
"""

from __future__ import annotations

from collections import Counter as TallyCounter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from gpuusage.api import names
from gpuusage.api.announcement import Announcement, decode
from gpuusage.api.models import OrphanedMemory
from gpuusage.api.policy import NodeRule
from gpuusage.api.times import format_time, parse_time
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.findings import finding_of
from gpuusage_operator.policies.noderule import due_of

ResultKind = Literal["fail", "warn", "error", "skip"]
Severity = Literal["critical", "high", "medium", "low", "info"]


@dataclass(frozen=True)
class Rule:
    """How one finding is published."""

    result: ResultKind
    severity: Severity


RULES: Final[dict[str, Rule]] = {
    "UsingUnrequestedGPU": Rule("fail", "high"),
    "UsingUnallocatedGPU": Rule("fail", "high"),
    "HoldingIdleGPU": Rule("warn", "medium"),
    "RequestedGPUsIdle": Rule("warn", "medium"),
    "OrphanedGPUMemory": Rule("warn", "medium"),
    "NodeReportStale": Rule("error", "medium"),
    "BlindDevices": Rule("error", "low"),
}
"""Each finding's result and severity. A GPU used outside what was handed fails; a GPU held
for nothing warns; a node gpuusage cannot judge (its report stale, devices it cannot see
whole) is an error: its pods' findings cannot be evaluated, not found clean."""
OMITTED: Final = "ResultsOmitted"
MAX_RESULTS: Final = 400
"""Results a report lists at most; those over it are counted in one ResultsOmitted result.
400 of the largest results still fit well within etcd's object size limit (a test holds it:
under 90 % of 1.5 MiB)."""
MAX_MESSAGE: Final = 1024
CATEGORY: Final = "GPU usage"
STATUS_FILTER: Final = ("fail", "warn", "error", "skip")
"""What the reports list: findings only, never a "pass" for each pod and node."""
CONTENT: Final = ("source", "configuration", "summary", "results")
"""The fields a report's writer compares and sends (metadata aside)."""
SEVERITY_ORDER: Final = ("critical", "high", "medium", "low", "info")


@dataclass(frozen=True)
class NodeFacts:
    """What a node's report says that the ClusterReport publishes."""

    node: str
    stale: bool
    orphaned: OrphanedMemory | None
    blind: tuple[tuple[str, str], ...] = ()
    """(device UUID, reason) of each device the report cannot show whole."""


def _timestamp(at: datetime) -> dict[str, int]:
    return {"seconds": int(at.timestamp()), "nanos": 0}


def _result(
    rule: str,
    policy: str,
    resource: dict[str, str],
    message: str,
    *,
    properties: Mapping[str, str] | None = None,
    found: datetime | None = None,
) -> dict[str, Any]:
    kind = RULES[rule]
    result: dict[str, Any] = {
        "source": names.OPENREPORT_SOURCE,
        "policy": policy,
        "rule": rule,
        "category": CATEGORY,
        "result": kind.result,
        "severity": kind.severity,
        "resources": [resource],
        "message": message[:MAX_MESSAGE],
    }
    if properties:
        result["properties"] = dict(sorted(properties.items()))
    if found is not None:
        result["timestamp"] = _timestamp(found)
    return result


def _policy_properties(action: str, mode: str, due: datetime | None, done: bool) -> dict[str, str]:
    found = {"action": action, "mode": mode}
    if due is not None:
        found["dueAt"] = format_time(due)
    if done:
        found["actionTaken"] = "true"
    return found


def pod_result(pod: PodSnapshot) -> dict[str, Any] | None:
    """The pod's finding as a result (None: it has none); without a timestamp unless the
    finding's start is known (the announcement's, or the idle condition's transition)."""
    condition = pod.our_condition
    finding = finding_of(condition)
    if finding is None or condition is None:
        return None
    ours = pod.our_annotations
    properties: dict[str, str] = {}
    if pod.node:
        properties["node"] = pod.node
    if ours.get(names.ANNOTATION_GPUS):
        properties["gpus"] = ours[names.ANNOTATION_GPUS]
    found = None
    if finding == "RequestedGPUsIdle":  # the condition turned False when the idleness began
        found = parse_time(condition.get("lastTransitionTime"))
    policy: str = finding
    shown: Announcement | None = decode(ours.get(names.ANNOTATION_POLICY_ACTION))
    if shown is not None and shown.finding == finding:
        policy = shown.policy
        properties.update(_policy_properties(shown.action, shown.mode, shown.due, shown.recorded))
        found = shown.since
    resource = {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": pod.namespace,
        "name": pod.name,
        "uid": pod.uid,
    }
    message = condition.get("message", "")
    return _result(finding, policy, resource, message, properties=properties, found=found)


def node_results(
    facts: NodeFacts, node_rule: tuple[str, NodeRule] | None = None
) -> list[dict[str, Any]]:
    """A node's findings as results: its report stale (nothing else about it is then said),
    memory no live pod holds, devices it cannot see whole. `node_rule`: the policy (by name)
    whose OrphanedGPUMemory rule acts on nodes, if one does."""
    node = facts.node
    resource = {"apiVersion": "v1", "kind": "Node", "name": node}
    report = f"GpuNodeUsage {node}"
    if facts.stale:
        message = (
            f"the GPU report of node {node} is stale: its agent has shown no sign of life for "
            "longer than the operator allows (its Lease's duration, or --stale-after), so "
            "nothing about its GPUs or pods can be judged"
        )
        return [_result("NodeReportStale", "NodeReportStale", resource, message)]
    found: list[dict[str, Any]] = []
    if facts.orphaned is not None:
        since = facts.orphaned.since
        message = (
            f"GPU memory on node {node} is held by processes of no live pod (of pods that are "
            f"gone, of containers no pod has, or of no container); {report} status.orphaned "
            "says how much"
        )
        properties: dict[str, str] = {}
        policy = "OrphanedGPUMemory"
        if node_rule is not None:
            policy, rule = node_rule[0], node_rule[1]
            due = due_of(rule, facts.orphaned)
            properties = _policy_properties(rule.action, rule.mode, due, False)
        found.append(
            _result(
                "OrphanedGPUMemory", policy, resource, message, properties=properties, found=since
            )
        )
    if facts.blind:
        listed = ", ".join(f"{uuid} ({why})" for uuid, why in facts.blind)
        message = (
            f"{len(facts.blind)} device(s) of node {node} cannot be seen whole: {listed}; a pod "
            "last seen on one is Unknown, and none is judged idle there"
        )
        properties = {"devices": ",".join(uuid for uuid, _ in facts.blind)}
        found.append(
            _result("BlindDevices", "BlindDevices", resource, message, properties=properties)
        )
    return found


def _resource(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object a result is about (none for ResultsOmitted: empty)."""
    found: Mapping[str, Any] = (result.get("resources") or [{}])[0]
    return found


def _key(result: Mapping[str, Any]) -> tuple[str, str]:
    resource = _resource(result)
    return (str(resource.get("uid") or resource.get("name") or ""), str(result.get("rule", "")))


def _order(result: Mapping[str, Any]) -> tuple[int, str, str, str]:
    resource = _resource(result)
    return (
        SEVERITY_ORDER.index(result["severity"]),
        str(resource.get("name", "")),
        str(result["rule"]),
        str(resource.get("uid", "")),
    )


def stamped(
    results: Iterable[dict[str, Any]], previous: Sequence[Mapping[str, Any]], now: datetime
) -> list[dict[str, Any]]:
    """The results, each with a timestamp: its finding's start where known, else the time it
    was first published (kept from `previous`, the report as it stands), else `now`."""
    before = {_key(r): r.get("timestamp") for r in previous}
    return [
        r if "timestamp" in r else {**r, "timestamp": before.get(_key(r)) or _timestamp(now)}
        for r in results
    ]


def report_content(
    results: Iterable[dict[str, Any]], max_results: int = MAX_RESULTS
) -> dict[str, Any]:
    """A report's content (CONTENT) with these results: most severe first, at most
    `max_results`, those left out counted in a last ResultsOmitted result."""
    ordered = sorted(results, key=_order)
    listed = ordered[:max_results]
    if len(ordered) > max_results:
        left = len(ordered) - max_results
        listed.append(
            {
                "source": names.OPENREPORT_SOURCE,
                "policy": OMITTED,
                "rule": OMITTED,
                "category": CATEGORY,
                "result": "skip",
                "severity": "info",
                "message": f"{left} more finding(s) not listed: a report lists at most "
                f"{max_results}, the most severe first",
                "properties": {"omitted": str(left)},
            }
        )
    tally = TallyCounter(r["result"] for r in listed)
    return {
        "source": names.OPENREPORT_SOURCE,
        "configuration": {
            "limits": {"maxResults": max_results, "statusFilter": list(STATUS_FILTER)}
        },
        "summary": {k: tally.get(k, 0) for k in ("pass", "fail", "warn", "error", "skip")},
        "results": listed,
    }


def kept_results(content: Mapping[str, Any], nodes: Collection[str]) -> list[dict[str, Any]]:
    """The results a report's content holds about these nodes, or about pods on them (as they
    stand): ours only, as we write them (a hand-edited result that is not is dropped, never
    republished)."""
    kept = []
    for result in content.get("results") or []:
        if not isinstance(result, dict):
            continue
        resource = _resource(result)
        ours = result.get("source") == names.OPENREPORT_SOURCE and result.get("rule") in RULES
        valid = result.get("severity") in SEVERITY_ORDER and result.get("result") in STATUS_FILTER
        properties = result.get("properties")
        on = properties.get("node") if isinstance(properties, dict) else None
        about = resource.get("name") if resource.get("kind") == "Node" else on
        if ours and valid and resource.get("kind") in ("Node", "Pod") and about in nodes:
            kept.append(result)
    return kept


def namespace_results(pods: Iterable[PodSnapshot]) -> dict[str, list[dict[str, Any]]]:
    """Each namespace's pod findings as results (namespaces without any are left out)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        result = pod_result(pod)
        if result is not None:
            found.setdefault(pod.namespace, []).append(result)
    return found
