"""The DRA indexes: ResourceClaims and ResourceSlices, kept by informers (never a list per
report).

Kubernetes serves DRA as resource.k8s.io/v1 from 1.34, as v1beta2 and v1beta1 on 1.32-1.33
(v1beta1 alone on 1.32). The watch reads the first of v1, v1beta2, v1beta1 the cluster serves
(claims and their results have one shape in all three; a v1beta1 slice nests each device's
attributes under `basic`, which dra.slice_devices reads too). On a cluster serving none of
them, or where the operator may not read it, nothing about claims is known: pods with claims
are then judged as having an allocation of unknown devices (never "unrequested"), and the
reason is logged once."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kubernetes import client

from gpuusage.kube import raw
from gpuusage.kube.errors import Forbidden, NotFound, translate
from gpuusage_operator.index.dra import NO_DRA, ClaimState, DraLookup, SliceState
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.informer import (
    WATCH_IDLE,
    Informer,
    OptionalWatch,
    watch_kwargs,
)

log = logging.getLogger(__name__)

VERSIONS = ("v1", "v1beta2", "v1beta1")
"""resource.k8s.io versions the watch reads, in the order it prefers them."""


GROUP = "resource.k8s.io"


class ResourceApi:
    """The two lists (and watches) of resource.k8s.io the informers make, at one version,
    sent through the client's object API (`/apis/<group>/<version>/<plural>`, the same
    requests): the generated ResourceV1Api classes of the `kubernetes` package, one per version,
    cost much resident memory on import (benchmarks/README.md, "Operator: memory at 5,000
    reports")."""

    def __init__(self, custom: Any, version: str) -> None:
        self._custom = custom  # kubernetes.client.CustomObjectsApi
        self.version = version

    def list_resource_claim_for_all_namespaces(self, **kwargs: Any) -> Any:
        return self._custom.list_cluster_custom_object(
            GROUP, self.version, "resourceclaims", **kwargs
        )

    def list_resource_slice(self, **kwargs: Any) -> Any:
        return self._custom.list_cluster_custom_object(
            GROUP, self.version, "resourceslices", **kwargs
        )


def resource_apis(api: client.ApiClient) -> list[tuple[str, Any]]:
    """The DRA API at each version of VERSIONS."""
    custom = client.CustomObjectsApi(api)
    return [(version, ResourceApi(custom, version)) for version in VERSIONS]


class DraWatch(OptionalWatch):
    """Two informers (claims, slices) on the first served version of `apis` (see
    resource_apis), started together; `lookup()` reads both."""

    def __init__(
        self,
        apis: Sequence[tuple[str, Any]],
        *,
        health: ApiHealth | None = None,
        idle_timeout: float = WATCH_IDLE,
    ) -> None:
        self._apis = list(apis)
        self._health = health
        self._idle = idle_timeout
        self.version: str | None = None
        """The version read, once the probe found one."""
        self.claims: Informer[ClaimState] = self._claims(self._apis[0][1])
        self.slices: Informer[SliceState] = self._slices(self._apis[0][1])
        super().__init__(
            [self.claims, self.slices],
            lambda: None,  # unused: probe() below asks each version itself
            f"DRA (resource.k8s.io {', '.join(v for v, _ in self._apis)}) cannot be read (%s): "
            "pods with resource claims are taken to have GPUs of unknown devices",
        )

    def _claims(self, resource: Any) -> Informer[ClaimState]:
        return Informer(
            "resourceclaim",
            lambda limit, token: resource.list_resource_claim_for_all_namespaces(
                limit=limit, _continue=token, _preload_content=False
            ),
            lambda version, idle: resource.list_resource_claim_for_all_namespaces(
                **watch_kwargs(version, idle)
            ),
            ClaimState,
            health=self._health,
            idle_timeout=self._idle,
        )

    def _slices(self, resource: Any) -> Informer[SliceState]:
        return Informer(
            "resourceslice",
            lambda limit, token: resource.list_resource_slice(
                limit=limit, _continue=token, _preload_content=False
            ),
            lambda version, idle: resource.list_resource_slice(**watch_kwargs(version, idle)),
            SliceState,
            health=self._health,
            idle_timeout=self._idle,
        )

    def probe(self) -> bool:
        """Watch the first version the cluster serves (a 404 is a version it does not); a
        refusal (403), or no version served, is unreadable for good, logged once. Other errors
        are the informers' to retry."""
        last = self._apis[-1][0]
        for version, resource in self._apis:
            self._use(version, resource)
            try:
                raw.body(resource.list_resource_slice(limit=1, _preload_content=False))
            except Exception as exc:
                error = translate(exc)
                if isinstance(error, NotFound) and version != last:
                    continue
                if isinstance(error, NotFound | Forbidden):
                    log.warning(self._unavailable, error)
                    return False
            log.info("DRA read through resource.k8s.io/%s", version)
            return True
        return False  # not reached: the last version returned

    def _use(self, version: str, resource: Any) -> None:
        self.version = version
        self.claims, self.slices = self._claims(resource), self._slices(resource)
        self.informers = [self.claims, self.slices]

    def lookup(self) -> DraLookup:
        if not self.available.is_set():
            return NO_DRA
        return DraLookup(self.claims.state.by_name, self.slices.state.devices)
