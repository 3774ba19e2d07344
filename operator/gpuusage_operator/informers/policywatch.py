"""The GpuUsagePolicies and the namespaces' labels, kept by informers (never a read per pod).

A policy whose spec the models refuse (written past an older CRD, or with the schema bypassed)
is left out and logged once per generation: a policy that cannot be read never acts. Without
the CRD or the right to read it (an install without policies), nothing is watched and no
policy exists, which is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from gpuusage.api import names
from gpuusage.api.policy import GpuUsagePolicySpec, NodeRule
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import (
    WATCH_IDLE,
    Informer,
    OptionalWatch,
    watch_kwargs,
)
from gpuusage_operator.policies.select import covers, exempt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    name: str
    generation: int
    spec: GpuUsagePolicySpec
    observed: int | None = None
    """status.observedGeneration: the generation whose mode and rules the status shows."""


def _written(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the policy's status says that the operator reads back: observedGeneration (the
    actions it counts are read from the apiserver itself when needed: see policies.ledger)."""
    observed = (obj.get("status") or {}).get("observedGeneration")
    return {"observed": observed if isinstance(observed, int) else None}


class PolicyState:
    """The readable policies now, by name; `on_change` hears of each policy that came, changed
    or went (a policy's pods are judged again without waiting for a report to change)."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.policies: dict[str, Policy] = {}
        self._refused: set[tuple[str, int]] = set()
        self._on_change = on_change

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name, generation = str(meta.get("name") or ""), int(meta.get("generation") or 0)
        known = self.policies.get(name)
        if event_type == "DELETED":
            if self.policies.pop(name, None) is not None:
                self._on_change()
            return
        if known is not None and known.generation == generation:
            # only its status changed (decisions): no pod is judged again for it
            self.policies[name] = replace(known, **_written(obj))
            return
        try:
            spec = GpuUsagePolicySpec.model_validate(obj.get("spec") or {})
        except ValidationError as exc:
            self.policies.pop(name, None)
            if (name, generation) not in self._refused:
                self._refused.add((name, generation))
                log.warning("GpuUsagePolicy %s cannot be read, it does nothing: %s", name, exc)
            return
        self.policies[name] = Policy(name, generation, spec, **_written(obj))
        self._on_change()

    def ids(self) -> set[str]:
        return set(self.policies)

    def __len__(self) -> int:
        return len(self.policies)


@dataclass(frozen=True)
class NamespaceFacts:
    labels: Mapping[str, str]
    exempt: bool


class NamespaceState:
    """Each namespace's labels and opt-out; `on_change` hears when those of a namespace that
    was already known change (which policy covers its pods may have changed)."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.namespaces: dict[str, NamespaceFacts] = {}
        self._on_change = on_change

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if event_type == "DELETED":
            self.namespaces.pop(name, None)
            return
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        facts = NamespaceFacts(labels, exempt(meta.get("annotations")))
        known = self.namespaces.get(name)
        self.namespaces[name] = facts
        if known is not None and known != facts:
            self._on_change()

    def ids(self) -> set[str]:
        return set(self.namespaces)

    def __len__(self) -> int:
        return len(self.namespaces)


class PolicyWatch(OptionalWatch):
    """Watches the policies and the namespaces; `covering` says which policy acts on a pod."""

    def __init__(
        self,
        custom: Any,
        core: Any,
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
            idle_timeout=idle_timeout,
        )
        self.namespaces: Informer[NamespaceState] = Informer(
            "namespace",
            lambda limit, token: core.list_namespace(
                limit=limit, _continue=token, _preload_content=False
            ),
            lambda version, idle: core.list_namespace(**watch_kwargs(version, idle)),
            lambda: NamespaceState(on_change),
            health=health,
            idle_timeout=idle_timeout,
        )
        super().__init__(
            [self.policies, self.namespaces],
            lambda: custom.list_cluster_custom_object(*group, limit=1, _preload_content=False),
            "GpuUsagePolicies cannot be read (%s): no policy acts",
        )

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
