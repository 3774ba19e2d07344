"""What a policy rule does next about one pod. Pure.

The pod's state of affairs is its finding as the judge decided it (see judge.findings:
observe), whether that is certain, and the announcement the operator left on the pod when the
finding first fell under the rule (the annotation gpuusage.io/policy-action: which policy,
finding and action, since when, due when). Announcing first is what makes acting safe: the
pod's owner sees, in the annotation and a Warning Event, what will happen and when, and the
announcement survives an operator restart or a handover between replicas, so no deadline starts
over and none is skipped. The steps:

* **Announce** when the rule's finding holds, is certain, and nothing is announced yet (or the
  rule changed since): due at the finding's start plus `after`, and never sooner than `notice`
  from now (a policy created over a long-idle pod warns before it acts).
* **Wait** until the due time while the finding holds.
* **Act** (Enforce) or **Record** (DryRun, once) when it is due.
* **Hold** while the pod's use is uncertain (Unknown, a stale or blind report): nothing is
  done and nothing is cancelled, as "not known" is neither the finding nor its end.
* **Cancel** when the finding cleared, the pod or its namespace became exempt, or the rule is
  gone: the announcement is removed and an Event says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

from gpuusage.api.announcement import Announcement
from gpuusage.api.policy import PodRule, parse_duration
from gpuusage_operator.judge.findings import Observation

StepKind = Literal["Announce", "Wait", "Act", "Record", "Hold", "Cancel", "Nothing"]


@dataclass(frozen=True)
class Step:
    kind: StepKind
    announcement: Announcement | None = None
    """The announcement the pod should carry after this step (None: none)."""
    why: str = ""
    """For Cancel: FindingCleared, Exempt, RuleRemoved."""
    until: datetime | None = None
    """For Wait: when to look again."""


def next_step(
    policy: str,
    rules: Sequence[PodRule] | None,
    seen: Observation,
    shown: Announcement | None,
    *,
    exempt: bool,
    now: datetime,
    notice: timedelta,
) -> Step:
    """The one step the policy takes about the pod now. `rules`: the policy's pod rules (None:
    the policy is gone or no longer covers the pod); `shown`: the announcement of this policy
    that the pod carries, if any."""
    if exempt:
        return Step("Cancel", why="Exempt") if shown else Step("Nothing")
    if rules is None:
        return Step("Cancel", why="RuleRemoved") if shown else Step("Nothing")
    if not seen.certain:
        return Step("Hold", shown) if shown else Step("Nothing")
    rule = next((r for r in rules if r.finding == seen.finding), None)
    if rule is None:
        if shown is None:
            return Step("Nothing")
        still = any(r.finding == shown.finding for r in rules)
        return Step("Cancel", why="FindingCleared" if still else "RuleRemoved")
    wanted = _announcement(policy, rule, seen, shown, now=now, notice=notice)
    if shown is None or wanted is not shown:
        return Step("Announce", wanted)
    if now < shown.due:
        return Step("Wait", shown, until=shown.due)
    if shown.recorded:
        return Step("Nothing", shown)
    if shown.mode == "Enforce":
        return Step("Act", shown)
    return Step("Record", replace(shown, recorded=True))


def _announcement(
    policy: str,
    rule: PodRule,
    seen: Observation,
    shown: Announcement | None,
    *,
    now: datetime,
    notice: timedelta,
) -> Announcement:
    """The announcement the rule wants: the one shown while the rule is unchanged (a deadline
    once announced stands); else a new one, due at the finding's start plus `after` and never
    sooner than `notice` from now (a rule made stricter warns again before it acts)."""
    if shown is not None and _same_rule(shown, rule):
        return shown
    kept = shown is not None and shown.finding == rule.finding
    since = shown.since if shown is not None and kept else (seen.since or now)
    due = max(since + parse_duration(rule.after), now + notice)
    return Announcement(policy, rule.finding, rule.action, rule.mode, rule.after, since, due)


def _same_rule(shown: Announcement, rule: PodRule) -> bool:
    return (shown.finding, shown.action, shown.mode, shown.after) == (
        rule.finding,
        rule.action,
        rule.mode,
        rule.after,
    )
