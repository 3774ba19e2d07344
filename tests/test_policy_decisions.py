"""Which pods a policy covers, and what it does next about one: announce, wait, act or record,
hold on uncertainty, cancel. Pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpuusage.api.announcement import Announcement, decode, encode
from gpuusage.api.models import Process
from gpuusage.api.policy import GpuUsagePolicySpec, LabelSelector, PodRule
from gpuusage.api.selectors import selects
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.informers.namespacewatch import NamespaceState
from gpuusage_operator.informers.policywatch import PolicyState
from gpuusage_operator.judge.allocation import Allocation, Judgement
from gpuusage_operator.judge.findings import Observation, finding_of, observe
from gpuusage_operator.judge.idle import Idle
from gpuusage_operator.judge.podstate import Verdict, desired_condition
from gpuusage_operator.judge.resolution import PodUse, Resolution
from gpuusage_operator.policies.limit import WINDOW, next_allowed, recent
from gpuusage_operator.policies.rule import Step, next_step
from gpuusage_operator.policies.select import covers, exempt, opt_out_hint, opted_out

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
NOTICE = timedelta(minutes=5)
IDLE = PodRule(finding="HoldingIdleGPU", after="30m", action="ScaleToZero", mode="Enforce")
MISUSE = PodRule(finding="UsingUnrequestedGPU", after="0s", action="Evict")
RULES = [IDLE, MISUSE]


def _selector(raw: dict[str, object]) -> LabelSelector:
    return LabelSelector.model_validate(raw)


@pytest.mark.parametrize(
    ("raw", "labels", "expected"),
    [
        ({}, {}, True),
        ({"matchLabels": {"app": "nb"}}, {"app": "nb", "x": "y"}, True),
        ({"matchLabels": {"app": "nb"}}, {"app": "train"}, False),
        (
            {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]},
            {"tier": "b"},
            True,
        ),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]}, {}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]},
            {"tier": "a"},
            False,
        ),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": "1"}, False),
        (
            {
                "matchLabels": {"app": "nb"},
                "matchExpressions": [{"key": "gpu", "operator": "Exists"}],
            },
            {"app": "nb"},
            False,
        ),
    ],
)
def test_selectors_read_as_kubernetes_reads_them(
    raw: dict[str, object], labels: dict[str, str], expected: bool
) -> None:
    assert selects(_selector(raw), labels) is expected


def test_a_policy_covers_pods_its_two_selectors_pick_and_exemption_is_an_annotation() -> None:
    spec = GpuUsagePolicySpec.model_validate(
        {
            "namespaceSelector": {"matchLabels": {"team": "research"}},
            "podSelector": {"matchLabels": {"app": "notebook"}},
            "rules": [{"finding": "HoldingIdleGPU", "action": "Notify"}],
        }
    )
    assert covers(spec, {"team": "research"}, {"app": "notebook"})
    assert not covers(spec, {"team": "ml"}, {"app": "notebook"})
    assert not covers(spec, {"team": "research"}, {"app": "train"})
    anywhere = GpuUsagePolicySpec.model_validate(
        {"rules": [{"finding": "HoldingIdleGPU", "action": "Notify"}]}
    )
    assert covers(anywhere, {}, {})
    assert exempt({"gpuusage.io/exempt": "true"})
    assert not exempt({"gpuusage.io/exempt": "false"})
    assert not exempt(None)


@pytest.mark.parametrize(
    ("pod_opt_out", "pod_exempt", "namespace_exempt", "expected"),
    [
        ("Allowed", False, False, False),
        ("Allowed", True, False, True),
        ("Allowed", False, True, True),
        ("Ignored", True, False, False),
        ("Ignored", False, True, True),
        ("Ignored", True, True, True),
    ],
)
def test_a_pods_own_opt_out_counts_only_where_the_policy_allows_it(
    pod_opt_out: str, pod_exempt: bool, namespace_exempt: bool, expected: bool
) -> None:
    spec = GpuUsagePolicySpec.model_validate({"podOptOut": pod_opt_out})
    annotations = {"gpuusage.io/exempt": "true"} if pod_exempt else {}
    assert opted_out(spec, annotations, namespace_exempt) is expected
    told = opt_out_hint(spec)
    assert ("annotate the pod" in told) is (pod_opt_out == "Allowed")


def test_pods_may_opt_out_unless_the_policy_says_otherwise() -> None:
    assert GpuUsagePolicySpec.model_validate({}).pod_opt_out == "Allowed"
    with pytest.raises(ValueError, match="podOptOut"):
        GpuUsagePolicySpec.model_validate({"podOptOut": "Never"})


def _step(
    seen: Observation,
    shown: Announcement | None = None,
    *,
    now: datetime = NOW,
    rules: list[PodRule] | None = RULES,
    is_exempt: bool = False,
) -> Step:
    return next_step("reclaim", rules, seen, shown, exempt=is_exempt, now=now, notice=NOTICE)


IDLE_SINCE = NOW - timedelta(minutes=10)
HELD = Observation("HoldingIdleGPU", certain=True, since=IDLE_SINCE)


def test_a_finding_is_announced_first_with_its_deadline() -> None:
    step = _step(HELD)
    assert step.kind == "Announce"
    assert step.announcement == Announcement(
        "reclaim",
        "HoldingIdleGPU",
        "ScaleToZero",
        "Enforce",
        "30m",
        IDLE_SINCE,
        IDLE_SINCE + timedelta(minutes=30),
    )


def test_a_long_standing_finding_still_gets_its_notice() -> None:
    """A policy created over a pod idle for hours warns before it acts."""
    old = Observation("HoldingIdleGPU", certain=True, since=NOW - timedelta(hours=5))
    step = _step(old)
    assert step.announcement is not None
    assert step.announcement.due == NOW + NOTICE


def test_it_waits_then_acts_when_enforced() -> None:
    shown = _step(HELD).announcement
    assert shown is not None
    waiting = _step(HELD, shown, now=NOW + timedelta(minutes=5))
    assert (waiting.kind, waiting.until) == ("Wait", shown.due)
    acting = _step(HELD, shown, now=shown.due)
    assert (acting.kind, acting.announcement) == ("Act", shown)


def test_a_dry_run_is_recorded_once() -> None:
    dry = [PodRule(finding="HoldingIdleGPU", after="30m", action="ScaleToZero")]
    shown = _step(HELD, rules=dry).announcement
    assert shown is not None
    assert shown.mode == "DryRun"
    recorded = _step(HELD, shown, now=shown.due, rules=dry)
    assert recorded.kind == "Record"
    assert recorded.announcement is not None
    assert recorded.announcement.recorded
    assert (
        _step(HELD, recorded.announcement, now=shown.due + timedelta(hours=1), rules=dry).kind
        == "Nothing"
    )


def test_uncertainty_holds_everything_and_announces_nothing() -> None:
    shown = _step(HELD).announcement
    unknown = Observation(None, certain=False)
    held = _step(unknown, shown, now=NOW + timedelta(hours=2))
    assert (held.kind, held.announcement) == ("Hold", shown), "neither acted upon nor cancelled"
    assert _step(Observation("HoldingIdleGPU", certain=False)).kind == "Nothing"


@pytest.mark.parametrize(
    ("seen", "rules", "is_exempt", "why"),
    [
        (Observation(None, certain=True), RULES, False, "FindingCleared"),
        (Observation("UsingUnallocatedGPU", certain=True), RULES, False, "FindingCleared"),
        (HELD, RULES, True, "Exempt"),
        (HELD, None, False, "RuleRemoved"),
        (HELD, [MISUSE], False, "RuleRemoved"),
    ],
)
def test_what_ends_an_announcement_cancels_it(
    seen: Observation, rules: list[PodRule] | None, is_exempt: bool, why: str
) -> None:
    shown = _step(HELD).announcement
    step = _step(seen, shown, rules=rules, is_exempt=is_exempt, now=NOW + timedelta(hours=1))
    assert (step.kind, step.why, step.announcement) == ("Cancel", why, None)


def test_a_rule_made_stricter_warns_again_and_an_unchanged_one_keeps_its_deadline() -> None:
    dry = [PodRule(finding="HoldingIdleGPU", after="30m", action="ScaleToZero")]
    shown = _step(HELD, rules=dry).announcement
    assert shown is not None
    later = shown.due + timedelta(minutes=1)
    stricter = _step(HELD, shown, now=later)
    assert stricter.kind == "Announce"
    assert stricter.announcement is not None
    assert stricter.announcement.due == later + NOTICE
    assert stricter.announcement.since == IDLE_SINCE, "the finding's start is kept"
    assert _step(HELD, shown, now=NOW + timedelta(minutes=1), rules=dry).kind == "Wait"


def test_another_finding_under_another_rule_replaces_the_announcement() -> None:
    shown = _step(HELD).announcement
    misuse = Observation("UsingUnrequestedGPU", certain=True)
    step = _step(misuse, shown, now=NOW + timedelta(minutes=1))
    assert step.kind == "Announce"
    assert step.announcement is not None
    assert (step.announcement.finding, step.announcement.action) == ("UsingUnrequestedGPU", "Evict")
    assert step.announcement.since == NOW + timedelta(minutes=1), (
        "its own start, not the idle one's"
    )


@pytest.mark.parametrize(
    ("condition", "finding"),
    [
        (None, None),
        ({"status": "True", "reason": "ProcessesRunning"}, None),
        ({"status": "True", "reason": "HoldingIdleGPU"}, "HoldingIdleGPU"),
        ({"status": "True", "reason": "UsingUnallocatedGPU"}, "UsingUnallocatedGPU"),
        ({"status": "False", "reason": "RequestedGPUsIdle"}, "RequestedGPUsIdle"),
        ({"status": "False", "reason": "ProcessesEnded"}, None),
        ({"status": "Unknown", "reason": "NodeReportStale"}, None),
        ({"status": "Unknown", "reason": "ContainerRestarted"}, None),
    ],
)
def test_a_pods_condition_states_its_finding(
    condition: dict[str, str] | None, finding: str | None
) -> None:
    assert finding_of(condition) == finding


POD = PodSnapshot("ml", "nb", "uid-1", "n1", gpu_requests=1)
USE = PodUse(POD, "n1", NOW, (Resolution("GPU-0", Process(pid=7, used_memory_mib=1024), POD),))
GIVEN = Allocation(("DevicePlugin",))
HOLDING = Judgement(GIVEN, held_idle_since=IDLE_SINCE)
VERDICTS = [
    (Verdict(POD, "InUse", USE, judgement=Judgement(Allocation(), "Unrequested")), None),
    (Verdict(POD, "InUse", USE, judgement=Judgement(GIVEN, "Unallocated", ("GPU-0",))), None),
    (
        Verdict(POD, "InUse", USE, judgement=Judgement(GIVEN, held_idle_since=IDLE_SINCE)),
        IDLE_SINCE,
    ),
    (Verdict(POD, "InUse", USE, judgement=Judgement(GIVEN)), None),
    (Verdict(POD, "Idle", idle=Idle(POD, IDLE_SINCE, GIVEN)), IDLE_SINCE),
    (Verdict(POD, "Stopped"), None),
]


@pytest.mark.parametrize(("verdict", "since"), VERDICTS)
def test_the_policies_take_the_finding_the_pods_condition_states(
    verdict: Verdict, since: datetime | None
) -> None:
    """One rule names a pod's finding: what the policies are handed is what the condition the
    judge wants for the pod states, with the finding's start where the judge knows it."""
    seen = observe(verdict.state, verdict.judgement, verdict.idle)
    condition = desired_condition(
        verdict.state, verdict.use, "n1", verdict.idle, judgement=verdict.judgement
    )
    assert seen.certain
    assert seen.finding == finding_of(condition)
    assert seen.since == since


def test_unknown_use_is_no_finding_and_no_end_of_one() -> None:
    assert observe("Unknown", None, None) == Observation(None, certain=False)


def test_an_announcement_reads_back_as_written_and_a_garbled_one_is_none() -> None:
    shown = _step(HELD).announcement
    assert shown is not None
    assert decode(encode(shown)) == shown
    recorded = Announcement(**{**shown.__dict__, "recorded": True})
    assert decode(encode(recorded)) == recorded
    assert '"due":"2026-11-25T12:20:00Z"' in encode(shown)
    for garbled in (
        None,
        "",
        "{",
        "[]",
        '{"policy":"p"}',
        encode(shown).replace("2026-11", "soon"),
    ):
        assert decode(garbled) is None, garbled


def _object(name: str, generation: int = 1, **more: object) -> dict[str, object]:
    return {"metadata": {"name": name, "generation": generation, **more}}


def test_what_changes_which_policy_covers_a_pod_asks_for_its_nodes_again() -> None:
    """A policy that comes, changes or goes, a namespace whose labels or opt-out change: the
    pods' nodes are reconciled again (no report need change). A policy's own status write
    (same generation), a new namespace or an unreadable policy does not."""
    calls: list[str] = []
    policies = PolicyState(lambda: calls.append("policy"))
    rules = {"rules": [{"finding": "HoldingIdleGPU", "action": "Notify"}]}
    policies.apply("ADDED", {**_object("p"), "spec": rules})
    policies.apply("MODIFIED", {**_object("p"), "spec": rules, "status": {"actionsTaken": 1}})
    policies.apply("MODIFIED", {**_object("p", 2), "spec": rules})
    policies.apply("MODIFIED", {**_object("q"), "spec": {"rules": [{"finding": "Nope"}]}})
    policies.apply("DELETED", _object("p", 2))
    assert calls == ["policy", "policy", "policy"]
    assert policies.ids() == set()
    namespaces = NamespaceState(lambda: calls.append("namespace"))
    namespaces.apply("ADDED", _object("ml", labels={"team": "a"}))
    namespaces.apply("MODIFIED", _object("ml", labels={"team": "a"}))
    namespaces.apply("MODIFIED", _object("ml", labels={"team": "b"}))
    namespaces.apply(
        "MODIFIED", _object("ml", labels={"team": "b"}, annotations={"gpuusage.io/exempt": "true"})
    )
    assert calls[3:] == ["namespace", "namespace"]
    assert namespaces.namespaces["ml"].exempt


def test_rate_limits_count_a_sliding_hour_per_policy_and_across_the_cluster() -> None:
    """A policy at its limit waits until its oldest action in the hour is an hour old; the
    cluster's cap counts every policy's actions; actions older than an hour count no more."""
    now = NOW
    minutes = [now - timedelta(minutes=m) for m in (50, 20, 5)]
    acted = {"a": minutes, "b": [now - timedelta(minutes=70)]}
    assert next_allowed("a", acted, per_policy=4, cluster=10, now=now) is None
    assert next_allowed("a", acted, per_policy=3, cluster=10, now=now) == minutes[0] + WINDOW
    assert next_allowed("a", acted, per_policy=2, cluster=10, now=now) == minutes[1] + WINDOW
    assert next_allowed("b", acted, per_policy=1, cluster=10, now=now) is None  # aged out
    assert next_allowed("b", acted, per_policy=1, cluster=3, now=now) == minutes[0] + WINDOW
    assert next_allowed("c", acted, per_policy=5, cluster=4, now=now) is None
    # a time after now counts: another worker's action, whose reconcile began later
    ahead = now + timedelta(seconds=1)
    assert recent([ahead, *minutes], now) == [*minutes, ahead]
    assert next_allowed("a", {"a": [ahead]}, per_policy=1, cluster=10, now=now) == ahead + WINDOW


def test_a_policys_status_is_kept_from_its_watch_without_judging_pods_again() -> None:
    """What the ledger builds on (see policies.ledger) comes with each event; a field the
    status holds wrong reads as none."""
    calls: list[str] = []
    policies = PolicyState(lambda: calls.append("policy"))
    rules = {"rules": [{"finding": "HoldingIdleGPU", "action": "Notify"}]}
    policies.apply("ADDED", {**_object("p", resourceVersion="7"), "spec": rules})
    assert policies.policies["p"].observed is None
    assert policies.policies["p"].version == "7"
    done = {"target": {"kind": "Pod", "name": "a"}, "outcome": "Done", "done": True}
    written = {
        "observedGeneration": 1,
        "actionsTaken": 4,
        "decisions": [done, "garbled"],
        "actedAt": ["2026-01-01T10:00:00Z", "soon"],
    }
    policies.apply(
        "MODIFIED", {**_object("p", resourceVersion="8"), "spec": rules, "status": written}
    )
    assert calls == ["policy"]
    kept = policies.policies["p"]
    assert (kept.observed, kept.version, kept.actions_taken) == (1, "8", 4)
    assert kept.decisions == (done,)
    assert kept.acted_at == (datetime(2026, 1, 1, 10, tzinfo=UTC),)
    garbled = {"actionsTaken": "4", "decisions": {}, "actedAt": "2026-01-01T10:00:00Z"}
    policies.apply(
        "MODIFIED", {**_object("p", resourceVersion="9"), "spec": rules, "status": garbled}
    )
    kept = policies.policies["p"]
    assert (kept.actions_taken, kept.decisions, kept.acted_at) == (0, (), ())
