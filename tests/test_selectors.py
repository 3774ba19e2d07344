"""Label selectors in kubectl's string form (gpuusage.api.selectors): what each form stands
for, what the operator's --namespace-selector refuses and why."""

from __future__ import annotations

import pytest

from gpuusage.api.selectors import SelectorError, parse_selector, selects
from gpuusage.settings import SettingsError
from tests.builders import resolved_operator


def test_each_form_selects_as_the_apiserver_would() -> None:
    selector = parse_selector("team=research, tier==gpu,env in (prod, staging),!legacy,owner")
    assert selects(selector, {"team": "research", "tier": "gpu", "env": "prod", "owner": "x"})
    assert not selects(selector, {"team": "research", "tier": "gpu", "env": "dev", "owner": "x"})
    assert not selects(selector, {"team": "research", "tier": "gpu", "env": "prod"}), "no owner"
    legacy = {"team": "research", "tier": "gpu", "env": "prod", "owner": "x", "legacy": ""}
    assert not selects(selector, legacy)
    other = parse_selector("team!=research,example.com/zone notin (a)")
    assert selects(other, {}), "NotIn also matches an object without the label"
    assert not selects(other, {"team": "research"})
    assert not selects(other, {"example.com/zone": "a"})
    assert parse_selector("").match_expressions == []
    assert selects(parse_selector(""), {"any": "thing"}), "empty: everything"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("gpu>1", "is not a label requirement"),
        ("team=research,", "an empty requirement"),
        ("env in (prod", "unbalanced parentheses"),
        ("env in ()", "is not a label value"),
        ("team=re search", "is not a label requirement"),
        ("=research", "is not a label requirement"),
        ("Example.COM/team=a", "is not a label requirement"),
        ("a" * 64 + "=b", "too long"),
        ("team=" + "b" * 64, "at most 63"),
    ],
)
def test_what_the_apiserver_would_not_parse_is_refused_saying_where(text: str, said: str) -> None:
    with pytest.raises(SelectorError, match=said):
        parse_selector(text)


def test_the_operator_refuses_a_bad_namespace_selector_at_start() -> None:
    with pytest.raises(SettingsError, match=r"--namespace-selector: .*is not a label requirement"):
        resolved_operator("--namespace-selector", "gpu>1")
    settings = resolved_operator("--namespace-selector", "team in (a,b)", "--no-pod-marks")
    scope = settings.scope(lambda namespace: {"team": "a"} if namespace == "ml" else {})
    assert not settings.pod_marks
    assert scope.selected("ml") is True
    assert scope.selected("web") is False
    assert scope.writes("ml") is False, "no pod marks: no writes anywhere"
