"""The DRA indexes: ResourceClaims and ResourceSlices, kept by informers (never a list per
report). On a cluster without the resource.k8s.io/v1 API, or where the operator may not read
it, nothing about claims is known: pods with claims are then judged as having an allocation of
unknown devices (never "unrequested"), and the reason is logged once."""

from __future__ import annotations

import logging
import threading
from typing import Any

from gpuusage.kube.errors import Forbidden, NotFound, translate
from gpuusage_operator.apihealth import ApiHealth
from gpuusage_operator.dra import NO_DRA, ClaimState, DraLookup, SliceState
from gpuusage_operator.informer import Informer, watch_kwargs

log = logging.getLogger(__name__)


class DraWatch:
    """Two informers (claims, slices), started together; `lookup()` reads both."""

    def __init__(self, resource: Any, *, health: ApiHealth | None = None) -> None:
        self._resource = resource  # kubernetes.client.ResourceV1Api
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
        self.available = threading.Event()
        self.decided = threading.Event()
        """Set once it is known whether the DRA API can be read (then `available` says)."""
        self._threads: list[threading.Thread] = []

    def probe(self) -> bool:
        """Whether the DRA API is served and readable: a 404 or a 403 says it is not, for good
        (an operator restart picks up a new API or new permissions); other errors are
        retried by the informers."""
        try:
            self._resource.list_resource_slice(limit=1, _preload_content=False).release_conn()
        except Exception as exc:
            error = translate(exc)
            if isinstance(error, NotFound | Forbidden):
                log.warning(
                    "DRA (resource.k8s.io/v1) cannot be read (%s): pods with resource claims "
                    "are taken to have GPUs of unknown devices",
                    error,
                )
                return False
        return True

    def start(self) -> None:
        if self.probe():
            self.available.set()
            for informer in (self.claims, self.slices):
                thread = threading.Thread(target=informer.run, name=informer.what, daemon=True)
                thread.start()
                self._threads.append(thread)
        self.decided.set()

    @property
    def synced(self) -> bool:
        return self.decided.is_set() and (
            not self.available.is_set()
            or (self.claims.synced.is_set() and self.slices.synced.is_set())
        )

    def lookup(self) -> DraLookup:
        if not self.available.is_set():
            return NO_DRA
        return DraLookup(self.claims.state.by_name, self.slices.state.devices)

    def stop(self) -> None:
        self.claims.stop()
        self.slices.stop()
