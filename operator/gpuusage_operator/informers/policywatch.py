"""The GpuUsagePolicies, kept by an informer, with the namespaces' (informers.namespacewatch):
which policy acts on which pod, never a read per pod.

Each policy is kept with what of its status the ledger builds its writes on (see
policies.ledger), so that no status is read apart from the watch: the version, the decisions
listed, the actions taken and counted. A write's answer is shown at once (`wrote`), and a
policy deleted still counts its actions for the cluster-wide limit while their hour lasts
(`acted`).

A policy whose spec the models refuse (written past an older CRD, or with the schema bypassed)
is left out and logged once per generation: a policy that cannot be read never acts. Without
the CRD or the right to read it (an install without policies), nothing is watched and no
policy exists, which is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from gpuusage.api import names
from gpuusage.api.policy import GpuUsagePolicySpec, NodeRule
from gpuusage.api.times import parse_time
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import (
    WATCH_IDLE,
    Informer,
    OptionalWatch,
    watch_kwargs,
)
from gpuusage_operator.informers.namespacewatch import NamespaceState
from gpuusage_operator.policies.limit import recent
from gpuusage_operator.policies.select import covers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    name: str
    generation: int
    spec: GpuUsagePolicySpec
    observed: int | None = None
    """status.observedGeneration: the generation whose mode and rules the status shows."""
    version: str = ""
    """metadata.resourceVersion: what a status write built on this view names."""
    decisions: tuple[dict[str, Any], ...] = ()
    """status.decisions, as served (a decision already listed is not listed or counted again)."""
    actions_taken: int = 0
    """status.actionsTaken."""
    acted_at: tuple[datetime, ...] = ()
    """status.actedAt: the enforced actions counted (see policies.limit)."""


def _written(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What of the policy's status the ledger builds on, and its version; a field the status
    holds wrong (past the schema) reads as none."""
    version = (obj.get("metadata") or {}).get("resourceVersion")
    status = obj.get("status") or {}
    observed, taken = status.get("observedGeneration"), status.get("actionsTaken")
    decisions, acted = status.get("decisions"), status.get("actedAt")
    times = (parse_time(t) for t in acted) if isinstance(acted, list) else ()
    return {
        "version": version if isinstance(version, str) else "",
        "observed": observed if isinstance(observed, int) else None,
        "decisions": tuple(d for d in decisions if isinstance(d, dict))
        if isinstance(decisions, list)
        else (),
        "actions_taken": taken if isinstance(taken, int) else 0,
        "acted_at": tuple(t for t in times if t is not None),
    }


class PolicyState:
    """The readable policies now, by name; `on_change` hears of each policy that came, changed
    or went (a policy's pods are judged again without waiting for a report to change). Its
    writers hold the informer's `writing` lock (see PolicyWatch)."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.policies: dict[str, Policy] = {}
        self._gone: dict[str, tuple[datetime, ...]] = {}
        """The actedAt of policies gone (deleted, or unreadable now), by name, until aged out.
        One that comes back under the name counts them on top of its status's, the same ones
        too where it is the same policy readable again: fewer actions, never more."""
        self._refused: set[tuple[str, int]] = set()
        self._on_change = on_change

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name, generation = str(meta.get("name") or ""), int(meta.get("generation") or 0)
        known = self.policies.get(name)
        if event_type == "DELETED":
            if self._drop(name):
                self._on_change()
            return
        if known is not None and known.generation == generation:
            # only its status changed (decisions): no pod is judged again for it
            self.policies[name] = replace(known, **_written(obj))
            return
        try:
            spec = GpuUsagePolicySpec.model_validate(obj.get("spec") or {})
        except ValidationError as exc:
            self._drop(name)
            if (name, generation) not in self._refused:
                self._refused.add((name, generation))
                log.warning("GpuUsagePolicy %s cannot be read, it does nothing: %s", name, exc)
            return
        self.policies[name] = Policy(name, generation, spec, **_written(obj))
        self._on_change()

    def wrote(self, name: str, built_on: str, answer: Mapping[str, Any]) -> None:
        """A status write built on the policy at version `built_on` landed: its answer is the
        policy's next version, shown now, so the next write builds on it and the next count
        includes it (the watch brings the same later). Where the state shows another version
        the watch has brought this write or a later one already: versions are opaque, only
        ever compared for equality."""
        known = self.policies.get(name)
        if known is not None and known.version == built_on:
            self.policies[name] = replace(known, **_written(answer))

    def acted(self, now: datetime) -> dict[str, list[datetime]]:
        """Each policy's enforced actions of the last hour, by name, with those of policies
        gone while their hour lasts: a policy deleted still counts for the cluster's limit."""
        for name in [n for n, times in self._gone.items() if not recent(times, now)]:
            del self._gone[name]
        counted = {name: recent(p.acted_at, now) for name, p in self.policies.items()}
        for name, times in self._gone.items():
            counted[name] = recent([*counted.get(name, ()), *times], now)
        return counted

    def listed_after(self, before: PolicyState) -> None:
        """This state, listed anew, replaces `before`: the policies gone that it remembered
        are remembered here, with those gone while no watch was open."""
        self._gone = dict(before._gone)
        for name, policy in before.policies.items():
            if name not in self.policies:
                self._gone[name] = self._gone.get(name, ()) + policy.acted_at

    def _drop(self, name: str) -> bool:
        """The policy leaves the state, its counted actions remembered; whether it was in."""
        known = self.policies.pop(name, None)
        if known is not None and known.acted_at:
            self._gone[name] = self._gone.get(name, ()) + known.acted_at
        return known is not None

    def ids(self) -> set[str]:
        return set(self.policies)

    def __len__(self) -> int:
        return len(self.policies)


class PolicyWatch(OptionalWatch):
    """Watches the policies and the namespaces; `covering` says which policy acts on a pod."""

    def __init__(
        self,
        custom: Any,
        namespaces: Informer[NamespaceState],
        *,
        health: ApiHealth | None = None,
        on_change: Callable[[], None] = lambda: None,
        idle_timeout: float = WATCH_IDLE,
    ) -> None:
        group = (names.GROUP, names.VERSION, names.POLICY_PLURAL)
        self.policies: Informer[PolicyState] = Informer(
            "gpuusagepolicy",
            lambda limit, token: custom.list_cluster_custom_object(
                *group, limit=limit, _continue=token, _preload_content=False
            ),
            lambda version, idle: custom.list_cluster_custom_object(
                *group, **watch_kwargs(version, idle)
            ),
            lambda: PolicyState(on_change),
            health=health,
            on_listed=self._listed,
            idle_timeout=idle_timeout,
        )
        self.namespaces = namespaces
        """The namespaces' labels and opt-out (informers.namespacewatch: watched whether or not
        policies are served, started and stopped by its owner)."""
        super().__init__(
            [self.policies],
            lambda: custom.list_cluster_custom_object(*group, limit=1, _preload_content=False),
            "GpuUsagePolicies cannot be read (%s): no policy acts",
        )

    @property
    def synced(self) -> bool:
        """The policies (where served) and the namespaces are listed: a policy never acts on a
        partial view."""
        return super().synced and self.namespaces.synced.is_set()

    def covering(self, namespace: str, pod_labels: Mapping[str, str]) -> tuple[Policy | None, bool]:
        """The policy that acts on a pod (the first by name among those whose selectors pick
        it), and whether its namespace opted out. None until both informers listed: a policy
        never acts on a partial view."""
        if not self.synced or not self.available.is_set():
            return None, False
        facts = self.namespaces.state.namespaces.get(namespace)
        if facts is None:
            return None, False
        for name in sorted(self.policies.state.policies):
            policy = self.policies.state.policies.get(name)
            if policy is not None and covers(policy.spec, facts.labels, pod_labels):
                return policy, facts.exempt
        return None, facts.exempt

    def node_rule(self) -> tuple[Policy, NodeRule] | None:
        """The OrphanedGPUMemory rule that acts on nodes: the first by name among the policies
        that have one (node rules cover every node with a report). None until listed."""
        if not self.synced or not self.available.is_set():
            return None
        for name in sorted(self.policies.state.policies):
            policy = self.policies.state.policies.get(name)
            if policy is None:
                continue
            for rule in policy.spec.node_rules:
                if rule.finding == "OrphanedGPUMemory":
                    return policy, rule
        return None

    def policy(self, name: str) -> Policy | None:
        return self.policies.state.policies.get(name)

    def wrote(self, name: str, built_on: str, answer: Mapping[str, Any]) -> bool:
        """Show a status write's answer now (see PolicyState.wrote); whether the state that
        counts from now on shows it: not while a list is under way, which may have been served
        before the write landed and replace the state with one from before it."""
        with self.policies.writing:  # no event applied, no list swapped in meanwhile
            self.policies.state.wrote(name, built_on, answer)
            return self.policies.synced.is_set()

    def acted(self, now: datetime) -> dict[str, list[datetime]] | None:
        """Each policy's enforced actions of the last hour (see PolicyState.acted); None until
        the policies are listed (again): nothing is decided on counts that may be partial."""
        with self.policies.writing:
            if not self.policies.synced.is_set():
                return None
            return self.policies.state.acted(now)

    def _listed(self, before: PolicyState, after: PolicyState) -> None:
        with self.policies.writing:
            after.listed_after(before)
