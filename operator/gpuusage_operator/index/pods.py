"""What the operator remembers about pods: a few fields, keyed by container ID and pod UID.

The index keeps an entry for every pod in the cluster, so the entry is deliberately small (no
specs, no full statuses). A pod that may hold GPUs or carries our marks is kept whole: its
PodSnapshot, under its UID, and found too under each container ID it has had reported
in its status (init, regular and ephemeral containers, the runtime scheme `containerd://`
stripped, as the agent reports bare IDs) and its node's keys (see index.keptpods). Every other
pod, most of a cluster's, is kept packed under its UID alone (see index.podpack: under 0.5 KiB
resident a pod).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpuusage.api import names
from gpuusage_operator.index.dra import extended_claim, pod_claims
from gpuusage_operator.judge.requests import (
    DEFAULT_RULES,
    AllocationRules,
    PodClaims,
    claim_names,
    fraction_of,
    gpu_requests,
    gpu_resources,
    mig_requests,
    without_served,
)

CONTAINER_KEY = "cid:"
MARKED_KEY = "marked:"
"""Pods carrying our annotations or condition, by node: clean-up needs them without a scan."""
REQUESTING_KEY = "requesting:"
"""Running pods that requested GPUs, by node: idle detection needs them without a scan."""
CLAIM_KEY = "claim:"
"""Running pods by each claim they name (`<namespace>/<claim>`): who share what it got."""


@dataclass(frozen=True, slots=True)
class PodSnapshot:
    """A pod as the operator needs it: who it is and which container IDs are its own."""

    namespace: str
    name: str
    uid: str
    node: str | None
    containers: tuple[tuple[str, str], ...] = ()
    """(container ID, container name) pairs from the pod's status."""
    annotations: tuple[tuple[str, str], ...] = ()
    """Our annotations only (gpuusage.io/...), to compute patches without reading the pod."""
    condition: tuple[tuple[str, str], ...] = ()
    """Our pod condition's fields, if the pod has it."""
    resource_version: str | None = None
    """Tells the reconciler whether this entry already shows its own latest writes."""
    gpu_requests: int = 0
    """GPUs the pod asked the scheduler for (nvidia.com/gpu, MIG and configured resources)."""
    gpu_resources: tuple[str, ...] = ()
    """Which of those resource names it asked for."""
    mig_requests: int = 0
    """The MIG slices among gpu_requests (nvidia.com/mig-*)."""
    fraction: str = ""
    """A fractional scheduler's share from the pod's annotations ("gpu-fraction=0.5")."""
    claims: tuple[str, ...] = ()
    """The names of its ResourceClaims (DRA), in its namespace."""
    pending_claims: int = 0
    """Template claims whose generated claim is not named in the pod's status yet."""
    extended_claim: str = ""
    """The claim the scheduler made for its extended resources that a DRA driver serves
    (`status.extendedResourceClaimStatus`); its requests are not in gpu_requests."""
    extended_requests: tuple[str, ...] = ()
    """That claim's requests standing for GPU resources."""
    running: bool = False
    """Phase Running and not being deleted: only such a pod can leave requested GPUs idle."""
    started_at: str | None = None
    """status.startTime (RFC 3339): when the kubelet accepted the pod."""
    labels: tuple[tuple[str, str], ...] = ()
    """Its labels, for policies' pod selectors: kept only for pods a policy may act on (marked
    by us, or holding GPUs), so the index stays small for the cluster's other pods."""
    exits: tuple[tuple[str, str], ...] = ()
    """(container name, finishedAt) of each container's latest exit that the kubelet restarts
    it from (its lastState, or its state while the pod runs on): see restarts."""

    @property
    def our_annotations(self) -> dict[str, str]:
        return dict(self.annotations)

    @property
    def marked(self) -> bool:
        """Whether it carries what the operator writes: a people's annotation of our group
        (gpuusage.io/exempt) alone marks nothing, or the pod would be "unmarked" with a
        condition it never had."""
        return bool(self.condition) or any(
            k in names.OPERATOR_ANNOTATIONS for k, _ in self.annotations
        )

    @property
    def may_hold_gpus(self) -> bool:
        """It asked for GPUs in one of the ways allocation counts (a request, a claim, a
        scheduler's share)."""
        return bool(self.gpu_requests > 0 or self.claims or self.extended_claim or self.fraction)

    @property
    def our_condition(self) -> dict[str, str] | None:
        return dict(self.condition) if self.condition else None

    @property
    def claimed(self) -> PodClaims:
        """What the pod itself says about its allocation (see allocation)."""
        return PodClaims(
            self.namespace,
            self.name,
            self.gpu_requests,
            self.gpu_resources,
            self.fraction,
            self.claims,
            self.pending_claims,
            self.extended_claim,
            self.extended_requests,
        )

    @property
    def claim_names(self) -> tuple[str, ...]:
        """Every claim it names, its extended-resource claim included."""
        return claim_names(self.claims, self.extended_claim)

    def container_name(self, container_id: str) -> str | None:
        return next((name for cid, name in self.containers if cid == container_id), None)


def bare_container_id(raw: str | None) -> str | None:
    """`containerd://abc…` → `abc…`; None or empty stays None."""
    if not raw:
        return None
    return raw.split("://", 1)[-1].lower() or None


def snapshot_of(
    body: Mapping[str, Any], rules: AllocationRules = DEFAULT_RULES
) -> PodSnapshot | None:
    """The PodSnapshot of a pod object (a dict as the API returns it); None without a UID."""
    meta = body.get("metadata") or {}
    uid = meta.get("uid")
    if not uid:
        return None
    status = body.get("status") or {}
    containers: list[tuple[str, str]] = []
    for field in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for item in status.get(field) or []:
            cid = bare_container_id(item.get("containerID"))
            if cid:
                containers.append((cid, str(item.get("name", ""))))
    ours, condition = pod_marks(body)
    claims, pending = pod_claims(body)
    extended = extended_claim(body, rules.counts)
    spec = without_served(body.get("spec") or {}, extended.served)
    ref = PodSnapshot(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(uid),
        node=(body.get("spec") or {}).get("nodeName"),
        containers=tuple(containers),
        annotations=ours,
        condition=condition,
        resource_version=meta.get("resourceVersion"),
        gpu_requests=gpu_requests(spec, rules),
        gpu_resources=gpu_resources(spec, rules),
        mig_requests=mig_requests(spec),
        fraction=fraction_of(meta.get("annotations") or {}, rules),
        claims=claims,
        pending_claims=pending,
        extended_claim=extended.name,
        extended_requests=extended.requests,
        running=status.get("phase") == "Running" and not meta.get("deletionTimestamp"),
        started_at=status.get("startTime"),
        exits=container_exits(status, (body.get("spec") or {}).get("restartPolicy")),
    )
    if ref.marked or ref.may_hold_gpus:
        labels = tuple(sorted((str(k), str(v)) for k, v in (meta.get("labels") or {}).items()))
        ref = replace(ref, labels=labels)
    return ref


Marks = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]


def pod_marks(body: Mapping[str, Any]) -> Marks:
    """What a pod object carries of our group: its gpuusage.io/ annotations and the fields of
    its GPUInUse condition (empty: none), each as sorted (key, value) pairs, as PodSnapshot
    keeps them."""
    meta = body.get("metadata") or {}
    ours = tuple(
        sorted(
            (k, str(v))
            for k, v in (meta.get("annotations") or {}).items()
            if k.startswith(names.GROUP + "/")
        )
    )
    condition = next(
        (
            c
            for c in (body.get("status") or {}).get("conditions") or []
            if c.get("type") == names.POD_CONDITION_GPU_IN_USE
        ),
        None,
    )
    fields = tuple(sorted((k, str(v)) for k, v in condition.items())) if condition else ()
    return ours, fields


def container_exits(
    status: Mapping[str, Any], restart_policy: str | None
) -> tuple[tuple[str, str], ...]:
    """Each app container's latest exit that a restart follows or will follow: the kubelet
    keeps the one before the running container in lastState; while the pod is Running, a
    terminated state is about to be restarted too, where the pod's restartPolicy says so."""
    found: list[tuple[str, str]] = []
    running = status.get("phase") == "Running"
    for item in status.get("containerStatuses") or []:
        state = (item.get("state") or {}).get("terminated") if running else None
        if state and not _restarts(restart_policy or "Always", state.get("exitCode")):
            state = None
        last = (item.get("lastState") or {}).get("terminated")
        finished = (state or last or {}).get("finishedAt")
        if finished:
            found.append((str(item.get("name", "")), str(finished)))
    return tuple(found)


def _restarts(policy: str, exit_code: object) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def snapshot_keys(ref: PodSnapshot) -> tuple[str, ...]:
    """The keys a pod kept whole is found under besides its UID: each of its container IDs,
    its node's key of pods with our marks (for clean-up) and of running pods that may hold
    GPUs (for idle judgement), so that a reconcile reads its node's pods, not the cluster's;
    and, while it runs, each claim it names (who share a claim's devices)."""
    keys = [CONTAINER_KEY + cid for cid, _ in ref.containers]
    if ref.node and ref.marked:
        keys.append(MARKED_KEY + ref.node)
    requesting = requesting_node(ref)
    if requesting:
        keys.append(REQUESTING_KEY + requesting)
        keys += [f"{CLAIM_KEY}{ref.namespace}/{claim}" for claim in ref.claim_names]
    return tuple(dict.fromkeys(keys))


def requesting_node(ref: PodSnapshot | None) -> str | None:
    """The node a running pod that may hold GPUs runs on (idle detection follows it)."""
    if ref is not None and ref.node and ref.running and ref.may_hold_gpus:
        return ref.node
    return None


class KeptLookup(Protocol):
    """The pods kept whole (see index.keptpods)."""

    def get(self, uid: str) -> PodSnapshot | None: ...

    def under(self, key: str) -> list[PodSnapshot]:
        """The pods found under one of snapshot_keys' keys, in the order they came."""
        ...

    def all_keys(self) -> list[str]:
        """Every key some pod is found under."""
        ...


class PlainLookup(Protocol):
    """The plain pods, kept packed (see index.podpack)."""

    def get(self, uid: str) -> PodSnapshot | None: ...

    def with_container(self, container_id: str) -> PodSnapshot | None: ...


class _Nobody:
    def get(self, uid: str) -> PodSnapshot | None:
        return None

    def with_container(self, container_id: str) -> PodSnapshot | None:
        return None

    def under(self, key: str) -> list[PodSnapshot]:
        return []

    def all_keys(self) -> list[str]:
        return []


class PodLookup:
    """Read access to the index, by container ID or pod UID.

    Several pods could in theory claim one container ID: the last one is taken, and such
    ambiguity is rare enough to ignore. Plain pods (no GPU, none of our marks) are kept apart,
    packed, under their UID alone: `by_uid` finds them, `by_container` does not (see
    `plain_with_container`).
    """

    def __init__(self, kept: KeptLookup | None = None, plain: PlainLookup | None = None) -> None:
        # `is None`, not falsiness: an index empty now is still read when pods come.
        self._kept: KeptLookup = kept if kept is not None else _Nobody()
        self._plain: PlainLookup = plain if plain is not None else _Nobody()

    def seen_through(self, view: Callable[[KeptLookup], KeptLookup]) -> PodLookup:
        """The same index with its kept pods seen through `view` (see controller.scope: what
        the judge is to take for the marks of pods the operator writes nothing on)."""
        return PodLookup(view(self._kept), self._plain)

    def by_container(self, container_id: str) -> PodSnapshot | None:
        """The pod keyed under this container ID: plain pods are not (a scan finds them)."""
        refs = self._kept.under(CONTAINER_KEY + container_id)
        return refs[-1] if refs else None

    def by_uid(self, uid: str) -> PodSnapshot | None:
        return self._kept.get(uid) or self._plain.get(uid)

    def plain_with_container(self, container_id: str) -> PodSnapshot | None:
        """The plain pod whose status lists this container ID: a scan of every plain pod, for
        a process whose cgroup names no pod UID."""
        return self._plain.with_container(container_id)

    def on_node_with_our_marks(self, node: str) -> list[PodSnapshot]:
        """Pods of a node that carry our annotations or condition (for clean-up).

        Read from the node's own index key, so a reconcile costs the node's pods, not the
        cluster's (a pod leaves the key as soon as it loses our marks).
        """
        return self._on_node(MARKED_KEY, node)

    def nodes_with_our_marks(self) -> set[str]:
        """Every node with a pod that carries our marks (one pass over the index's keys)."""
        keys = self._kept.all_keys()
        return {key[len(MARKED_KEY) :] for key in keys if key.startswith(MARKED_KEY)}

    def requesting_on_node(self, node: str) -> list[PodSnapshot]:
        """Running pods of a node that may hold GPUs (a request, a claim, a share; for idle
        detection), from their own key."""
        return self._on_node(REQUESTING_KEY, node)

    def claim_users(self, namespace: str, claim: str) -> int:
        """How many running pods name this claim (see dra.DraLookup.users)."""
        found = self._kept.under(f"{CLAIM_KEY}{namespace}/{claim}")
        return len({ref.uid for ref in found if ref.namespace == namespace and ref.running})

    def _on_node(self, prefix: str, node: str) -> list[PodSnapshot]:
        found = {ref.uid: ref for ref in self._kept.under(prefix + node) if ref.node == node}
        return list(found.values())
