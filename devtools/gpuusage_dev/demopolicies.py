"""The demo's policies: one DryRun and one enforced, announced first, on the pods both demos
run (research/lab holds a GPU idle, ml-team/train-1 runs on a GPU it was not given)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from gpuusage.api import names
from gpuusage.retry import poll_until
from gpuusage_commands.top import TopSettings, run_top


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 120.0) -> None:
    """Poll until `predicate` holds; an API error or a missing field counts as not yet."""

    def probe() -> Any:
        try:
            return predicate()
        except (client.ApiException, KeyError, IndexError, TypeError, StopIteration):
            return None

    if not poll_until(probe, timeout, 0.3):
        raise TimeoutError(f"demo: timed out waiting for {what}")


NOTICE = 5.0
"""Seconds between a policy's announcement and its action in the demo (--policy-notice)."""
POLICIES = (
    # name, namespace, finding, action, mode, podOptOut (misuse: the owner may not opt out)
    ("reclaim-idle", "research", "HoldingIdleGPU", "DeletePod", "DryRun", "Allowed"),
    ("stop-misuse", "ml-team", "UsingUnallocatedGPU", "Evict", "Enforce", "Ignored"),
)


def show_policies(
    step: Callable[[str], None], kubectl: list[str], api: client.ApiClient, kubeconfig: Path
) -> None:
    """Two policies: what each announces, records and does (the operator runs with
    --policy-actions and --policy-notice=NOTICE)."""
    core = client.CoreV1Api(api)
    step(
        "two GpuUsagePolicies: idle GPUs in research, DryRun (record only); misuse in "
        "ml-team, enforced (evict)"
    )
    custom = client.CustomObjectsApi(api)
    for name, namespace, finding, action, mode, opt_out in POLICIES:
        selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        rule = {"finding": finding, "after": "1s", "action": action, "mode": mode}
        body = {
            "apiVersion": names.API_VERSION,
            "kind": names.POLICY_KIND,
            "metadata": {"name": name},
            "spec": {"namespaceSelector": selector, "podOptOut": opt_out, "rules": [rule]},
        }
        custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.POLICY_PLURAL, body)
        owners = "" if opt_out == "Allowed" else "; a pod's own opt-out ignored"
        print(f"    {name}: {namespace}, {finding} -> {action} ({mode}{owners})")

    def announced(namespace: str, name: str) -> bool:
        meta: Any = core.read_namespaced_pod(name, namespace).metadata
        return names.ANNOTATION_POLICY_ACTION in (meta.annotations or {})

    wait_until(lambda: announced("research", "lab"), "the lab's announcement")
    wait_until(lambda: announced("ml-team", "train-1"), "train-1's announcement")
    step(f"announced first: the pods' owners have {NOTICE:g}s to react (the PENDING column)")
    print("\n$ gpuusage top -A", flush=True)
    run_top(TopSettings(kubeconfig=kubeconfig, all_namespaces=True))
    wait_until(_evicted(core, "ml-team", "train-1"), "train-1 evicted")
    wait_until(lambda: _outcomes(custom, "reclaim-idle") >= {"DryRun"}, "the dry run recorded")
    step("the enforced policy evicted train-1; the DryRun one recorded, and lab still runs")
    subprocess.run([*kubectl, "get", "gpuusagepolicies"], check=True)
    for namespace in ("research", "ml-team"):
        for reason, note in _policy_events(api, namespace):
            print(f"    {namespace}: {reason}: {note}")
    lab: Any = core.read_namespaced_pod("lab", "research")
    kept = "left alone" if lab.metadata.deletion_timestamp is None else "being deleted"
    print(f"    research/lab: {lab.status.phase}, {kept}")


def _evicted(core: client.CoreV1Api, namespace: str, name: str) -> Callable[[], bool]:
    """The pod is gone, or going (a simulated node has no kubelet to finish its deletion)."""

    def evicted() -> bool:
        try:
            meta: Any = core.read_namespaced_pod(name, namespace).metadata
        except client.ApiException as exc:
            return bool(exc.status == 404)
        return meta.deletion_timestamp is not None

    return evicted


def _outcomes(custom: client.CustomObjectsApi, policy: str) -> set[str]:
    body: Any = custom.get_cluster_custom_object(
        names.GROUP, names.VERSION, names.POLICY_PLURAL, policy
    )
    return {str(d.get("outcome")) for d in (body.get("status") or {}).get("decisions") or []}


def _policy_events(api: client.ApiClient, namespace: str) -> list[tuple[str, str]]:
    """The policy Events in the namespace, oldest first (read raw: the kubelet's have no
    eventTime, which the client's model refuses)."""
    raw: Any = client.EventsV1Api(api).list_namespaced_event(namespace, _preload_content=False)
    items = [
        e for e in json.loads(raw.data)["items"] if str(e.get("reason")).startswith("GPUPolicy")
    ]
    items.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(str(e["reason"]), str(e.get("note") or "")) for e in items]
