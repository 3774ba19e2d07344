"""What is left for a clock: the API probe, marks for nodes without a report, the OpenReports.

Everything else that no report event triggers is a deadline in the work queue (see
workqueue: a pod's idle time, marks settling, a report turning stale). Every `interval` this
pass checks that the API answers, so that an outage is logged once and its end once, and
queues the nodes whose pods carry our marks while the report watch holds no report for them (a
report deleted while no replica watched: the worker finds it absent and clears them), once a
term the Nodes that carry our OrphanedGPUMemory marks with no report (listed: neither mark can
be selected on; with policy actions only), and
brings the OpenReports in line with the findings (see openreports: a pass that finds nothing
changed writes nothing), and writes the policies' decisions that a reconcile could not (see
policies.ledger: none may come for a long time), and says once a term of each policy whose
pod rules the scope keeps from acting (pod marks off, namespaces outside the selector).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kubernetes import client

from gpuusage.api import names
from gpuusage.kube.errors import translate
from gpuusage_operator.controller.reconcile import Reconciler
from gpuusage_operator.controller.scope import Scope, outside_with_marks, unheeded
from gpuusage_operator.controller.triggers import DUE
from gpuusage_operator.ha.leader import ActiveGate
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.podwatch import PodWatch
from gpuusage_operator.informers.policywatch import PolicyWatch

log = logging.getLogger(__name__)
PROBE_TIMEOUT = 5.0


async def housekeeping(
    reconciler: Reconciler,
    pods: PodWatch,
    interval: float,
    gate: ActiveGate,
    *,
    health: ApiHealth,
    known: Callable[[], set[str]],
    ready: Callable[[], bool],
    publish: Callable[[], None] | None = None,
) -> None:
    """See the module's docstring; `known` tells the names of the reports the watch holds,
    `ready` whether the indexes are synced, `publish` brings the OpenReports in line
    (None: they are not published)."""
    loop = asyncio.get_running_loop()
    custom = client.CustomObjectsApi(reconciler.api)
    removed, carrying, refused_in, swept_in, said_in = 0, 0, None, None, None
    said: set[str] = set()  # the policies whose pod rules act not everywhere, said this term
    runner = reconciler.nodes
    marker = runner.marker if runner is not None else None

    def probe() -> bool:
        """A read that needs etcd (a consistent list), so that its outage is noticed too."""
        try:
            custom.list_cluster_custom_object(
                names.GROUP, names.VERSION, names.PLURAL, limit=1, _request_timeout=PROBE_TIMEOUT
            )
        except Exception as exc:
            health.failed("probe", translate(exc))
            return False
        health.succeeded()
        return True

    while True:
        await asyncio.sleep(interval)
        if not await loop.run_in_executor(None, probe):
            continue
        if not ready() or not await gate.active():
            continue
        try:
            lookup = pods.lookup()
            for node in lookup.nodes_with_our_marks() - known():
                reconciler.queue.add(node, DUE)
            scoped = not reconciler.scope.marks or reconciler.scope.selector is not None
            left = outside_with_marks(lookup, reconciler.scope) if scoped else 0
            if (reconciler.counts.marks_removed, left) != (removed, carrying):
                removed, carrying = reconciler.counts.marks_removed, left
                log.info(
                    "took gpuusage's marks off %d pods outside its scope (%s) so far; %d still "
                    "carry them",
                    removed,
                    reconciler.scope,
                    left,
                )
            if reconciler.marker.refused and refused_in is not reconciler.terms.current:
                refused_in = reconciler.terms.current  # said once a term
                log.warning(
                    "%d pods outside gpuusage's scope (%s) carry its marks from an earlier start, "
                    "which this install may not take off (no right to patch pods): grant it once "
                    "(the chart's operator.unmarkPods=true) or remove them by hand; see "
                    'docs/install.md, "Observe first"',
                    outside_with_marks(lookup, reconciler.scope),
                    reconciler.scope,
                )
            if said_in is not reconciler.terms.current:
                said_in, said = reconciler.terms.current, set()
            watch = reconciler.policies.watch if reconciler.policies is not None else None
            if watch is not None and watch.synced:
                lines = await loop.run_in_executor(None, _unheeded, watch, reconciler.scope)
                for name, line in lines.items():
                    if name not in said:  # said once a term for each policy
                        said.add(name)
                        log.warning("%s", line)
            if marker is not None and swept_in is not reconciler.terms.current:
                term = reconciler.terms.current
                found = await loop.run_in_executor(None, marker.marked)
                if isinstance(found, set):
                    swept_in = term
                    for node in found - known():
                        reconciler.queue.add(node, DUE)
                elif found.outcome == "NotPermitted":
                    swept_in = term  # said once a term; the rest goes on
                    log.warning(
                        "Nodes whose report went while no replica led may keep gpuusage's "
                        "OrphanedGPUMemory marks: %s (the policy-actions part grants list on "
                        "nodes)",
                        found.detail,
                    )
            if publish is not None:
                try:
                    await loop.run_in_executor(None, publish)
                except Exception:  # the next pass tries again; the pass itself must go on
                    log.exception("OpenReports not brought in line")
            if reconciler.policies is not None and reconciler.policies.ledger.waiting():
                await loop.run_in_executor(None, reconciler.policies.ledger.flush)
        except Exception:  # one pass failed: the next one tries again, the loop must go on
            log.exception(
                "a housekeeping pass failed; the next one, in %g s, tries again", interval
            )


def _unheeded(watch: PolicyWatch, scope: Scope) -> dict[str, str]:
    """scope.unheeded over the policies and namespaces the watches hold now (off the event
    loop: every namespace is looked at)."""
    policies = {n: p.spec for n, p in dict(watch.policies.state.policies).items()}
    labels = {n: f.labels for n, f in dict(watch.namespaces.state.namespaces).items()}
    return unheeded(policies, labels, scope)
