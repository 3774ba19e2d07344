"""The DRA indexes: ResourceClaims and ResourceSlices, kept by informers (never a list per
report). On a cluster without the resource.k8s.io/v1 API, or where the operator may not read
it, nothing about claims is known: pods with claims are then judged as having an allocation of
unknown devices (never "unrequested"), and the reason is logged once."""

from __future__ import annotations

import logging
from typing import Any

from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.dra import NO_DRA, ClaimState, DraLookup, SliceState
from gpuusage_operator.informer import Informer, OptionalWatch, watch_kwargs

log = logging.getLogger(__name__)


class DraWatch(OptionalWatch):
    """Two informers (claims, slices), started together; `lookup()` reads both."""

    def __init__(self, resource: Any, *, health: ApiHealth | None = None) -> None:
        self.claims: Informer[ClaimState] = Informer(
            "resourceclaim",
            lambda limit, token: resource.list_resource_claim_for_all_namespaces(
                limit=limit, _continue=token, _preload_content=False
            ),
            lambda version: resource.list_resource_claim_for_all_namespaces(
                **watch_kwargs(version)
            ),
            ClaimState,
            health=health,
        )
        self.slices: Informer[SliceState] = Informer(
            "resourceslice",
            lambda limit, token: resource.list_resource_slice(
                limit=limit, _continue=token, _preload_content=False
            ),
            lambda version: resource.list_resource_slice(**watch_kwargs(version)),
            SliceState,
            health=health,
        )
        super().__init__(
            [self.claims, self.slices],
            lambda: resource.list_resource_slice(limit=1, _preload_content=False),
            "DRA (resource.k8s.io/v1) cannot be read (%s): pods with resource claims are taken "
            "to have GPUs of unknown devices",
        )

    def lookup(self) -> DraLookup:
        if not self.available.is_set():
            return NO_DRA
        return DraLookup(self.claims.state.by_name, self.slices.state.devices)
