"""Judging one report: from what the agent published and the pods the operator knows to the
status the report should show, and the pods it speaks about. Pure (the pod index and DRA are
read through their lookups); the reconciler writes what is decided (see reconcile).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from gpuusage.api.models import GpuNodeUsageSpec, GpuNodeUsageStatus
from gpuusage_operator.index.dra import DraLookup
from gpuusage_operator.index.pods import PodLookup, PodSnapshot
from gpuusage_operator.judge.allocation import (
    Allocation,
    Judgement,
    KubeletView,
    allocation_of,
    judgements,
)
from gpuusage_operator.judge.certainty import (
    BlindSpots,
    blind_spots,
    devices_of,
    last_seen,
    sees_all,
)
from gpuusage_operator.judge.freshness import Freshness
from gpuusage_operator.judge.holding import held_idle, next_held_deadline
from gpuusage_operator.judge.idle import Idle, idle_pods, next_idle_deadline
from gpuusage_operator.judge.podstate import Verdict, verdicts
from gpuusage_operator.judge.requests import AllocationRules
from gpuusage_operator.judge.resolution import PodUse, Resolution, pod_uses, resolve_all
from gpuusage_operator.judge.showback import pod_allocations
from gpuusage_operator.judge.status import desired_status


@dataclass(frozen=True)
class JudgeSettings:
    """What judging a report takes besides the report and the pods: the operator's settings."""

    rules: AllocationRules
    driver_namespaces: frozenset[str]
    idle_after: timedelta | None
    restart_grace: timedelta


@dataclass(frozen=True)
class ReportJudgement:
    """What one report says, judged."""

    resolutions: list[Resolution]
    uses: dict[str, PodUse]
    """The pods it shows using GPUs, by UID."""
    pod_judgements: dict[str, Judgement]
    """How each pod in use stands against what it was handed, by UID."""
    idle: list[Idle]
    blind: BlindSpots
    status: GpuNodeUsageStatus
    verdicts: list[Verdict]
    """Every pod the report speaks about, with what it should carry (see podstate)."""
    wake: list[datetime]
    """When the judgement changes with nothing else changing (a pod's idle time reaching
    --idle-after, its marks settled, its restarting container's grace over): the report is to
    be judged again then."""
    listing: frozenset[str]
    """The UIDs of the pods the status lists (a deletion of one makes the report due)."""


def judge_report(
    spec: GpuNodeUsageSpec,
    previous: GpuNodeUsageStatus | None,
    *,
    generation: int | None,
    fresh: Freshness,
    lookup: PodLookup,
    dra: DraLookup,
    now: datetime,
    settings: JudgeSettings,
    absent: Mapping[str, datetime] | None = None,
    seen_on: Mapping[str, tuple[str, ...]] | None = None,
) -> ReportJudgement:
    """Judge one report (see the module's docstring). What was judged of the pods before, by
    UID: `absent`, when an earlier report first showed none of a pod's processes (see
    podstate.verdicts: its marks settle); `seen_on`, the devices it was last judged using
    (see certainty.last_seen)."""
    judged_before = seen_on or {}

    def last(pod: PodSnapshot) -> list[str] | None:
        return last_seen(pod, judged_before)

    rules = settings.rules
    dra = replace(dra, users=lookup.claim_users)  # who share a claim: the pods that name it
    resolutions = list(resolve_all(spec, lookup, settings.driver_namespaces))
    uses = pod_uses(spec.node_name, spec.observed_at, resolutions)
    pod_judgements = judgements(uses, spec, dra, rules)
    blind = blind_spots(spec, resolutions)
    kubelet = KubeletView.of(spec)
    candidates = lookup.requesting_on_node(spec.node_name)

    # the same rule, judged already
    handed = {uid: j.allocation for uid, j in pod_judgements.items()}

    def allocated(pod: PodSnapshot) -> Allocation:
        """What the pod was handed, worked out once per report (idle, held idle and showback
        all ask)."""
        if pod.uid not in handed:
            handed[pod.uid] = allocation_of(pod.claimed, dra, rules, kubelet)
        return handed[pod.uid]

    def seen_whole(pod: PodSnapshot, used: Iterable[str] = ()) -> bool:
        """Whether the report sees every device the pod could be using: a blind device
        withholds judgement on its own pods, never on the whole node."""
        return sees_all(blind, devices_of(allocated(pod), used, pod, spec, last))

    idle: list[Idle] = []
    wake: list[datetime] = []
    if not fresh.stale:
        judgeable = [p for p in candidates if p.uid not in uses and seen_whole(p)]
        idle = idle_pods(judgeable, uses, now, settings.idle_after, allocated)
        whole = [u for u in uses.values() if seen_whole(u.pod, u.devices)]
        in_use = frozenset(uses)
        wake += [
            d
            for d in (
                next_idle_deadline(judgeable, in_use, now, settings.idle_after),
                next_held_deadline(whole, fresh.sighting.seen_at, now, settings.idle_after),
            )
            if d is not None
        ]
        held = held_idle(whole, fresh.sighting.seen_at, now, settings.idle_after)
        pod_judgements = {
            uid: replace(j, held_idle_since=held[uid]) if uid in held else j
            for uid, j in pod_judgements.items()
        }
    allocations = pod_allocations(candidates, allocated)
    status = desired_status(
        spec,
        resolutions,
        now,
        generation=generation,
        fresh=fresh,
        previous=previous,
        idle=[i.entry() for i in idle],
        allocations=allocations,
        pod_judgements=pod_judgements,
        blind=blind,
    )
    found = verdicts(
        uses,
        lookup.on_node_with_our_marks(spec.node_name),
        idle,
        stale=status.stale,
        blind=blind,
        pod_judgements=pod_judgements,
        restarts=(now, settings.restart_grace),
        last=last,
        absent=absent,
        node=spec.node_name,
    )
    wake += [w for w in (verdict.wakes for verdict in found) if w is not None]
    listing = (
        frozenset(uses)
        | frozenset(i.pod.uid for i in idle)
        | frozenset(a.uid for a in allocations[0])
    )
    return ReportJudgement(
        resolutions, uses, pod_judgements, idle, blind, status, found, wake, listing
    )
