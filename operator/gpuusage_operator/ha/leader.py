"""High availability: which replica writes. The one place for it besides the pure rule.

Replicas meet in a ClusterKopfPeering (created here if missing). kopf pauses a standby
replica's watches, but only once it has seen a peer with a higher priority, and not our own
housekeeping task. Replicas that start together would both act for a moment, so every write
path first asks an ActiveGate, which applies kopf's rule (peering.is_active) to a fresh read of
the peering object after a short settling time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kubernetes import client

from gpuusage.api import names
from gpuusage.api.times import Clock, utc_now
from gpuusage.kube.crds import ensure_peering
from gpuusage_operator.ha.peering import Peering, is_active, random_priority
from gpuusage_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def join_peering(
    settings: OperatorSettings, api: client.ApiClient, identity: str
) -> Peering | None:
    """This replica's place among its peers (None when standalone); the peering object is
    created when missing."""
    if settings.standalone:
        return None
    priority = random_priority() if settings.priority is None else settings.priority
    peering = Peering(settings.peering, identity, priority, settings.peering_lifetime)
    log.info("peering %r as %s with priority %d", peering.name, identity, priority)
    try:
        ensure_peering(api, peering.name)
    except Exception as exc:  # kopf then says clearly that the peering is missing
        log.warning("cannot create ClusterKopfPeering %s: %s", peering.name, exc)
    return peering


class ActiveGate:
    """Whether this replica may write now, by kopf's peering rule on a fresh read.

    A "yes" is remembered for a second (a handover may then see one duplicate write, which is
    idempotent); a "no" never is, so a replica that has just become active is never held back
    by what it read before.
    """

    REMEMBER_YES = 1.0

    def __init__(
        self,
        api: client.ApiClient,
        peering: Peering | None,
        clock: Clock = utc_now,
        on_active: Callable[[], None] = lambda: None,
    ) -> None:
        self._custom = client.CustomObjectsApi(api)
        self._on_active = on_active
        """Called when this replica turns active after a spell on standby (another replica
        may have written meanwhile)."""
        self._peering = peering
        self._clock = clock
        self._settled_at = time.monotonic() + (peering.settle if peering else 0.0)
        self._yes_until = 0.0
        self._last: bool | None = None

    def _read(self) -> bool:
        assert self._peering is not None
        body = self._custom.get_cluster_custom_object(
            names.PEERING_GROUP, names.PEERING_VERSION, names.PEERING_PLURAL, self._peering.name
        )
        status = (body.get("status") or {}) if isinstance(body, dict) else {}
        return is_active(status, self._peering.identity, self._peering.priority, self._clock())

    async def active(self) -> bool:
        """active_now, from the event loop (a read of the peering object runs in a thread)."""
        if self._peering is None:
            self._last = True
            return True
        if time.monotonic() < self._yes_until:
            return True
        return await asyncio.get_running_loop().run_in_executor(None, self.active_now)

    def active_now(self) -> bool:
        """Whether this replica may write now (blocks while the peers settle at start)."""
        if self._peering is None:
            self._last = True
            return True
        wait = self._settled_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        if time.monotonic() < self._yes_until:
            return True
        try:
            answer = self._read()
        except Exception as exc:  # cannot tell: a standby must not write
            log.warning("cannot read peering %s: %s", self._peering.name, exc)
            answer = False
        if answer:
            self._yes_until = time.monotonic() + self.REMEMBER_YES
        if answer != self._last:
            log.info("this replica is %s", "active" if answer else "on standby")
            if answer and self._last is False:
                self._on_active()
            self._last = answer
        return answer

    @property
    def last(self) -> bool:
        """The latest answer (False before the first); for the `active` metric."""
        return bool(self._last)
