"""High availability: which replica is active, by kopf's peering rules. Pure, plus identity.

Replicas share one `ClusterKopfPeering` object; each writes `status.<identity>` with its
priority, lifetime and last-seen time, and kopf pauses every replica that sees a live peer with
a higher or equal priority. kopf pauses its own watches, but not tasks we start ourselves: the
staleness check (a clock, not an event) asks `is_active` before it writes anything, using the
same rules on the same object, so exactly one replica ever writes to pods.

Equal priorities would freeze every replica, so each replica draws a random priority at start
unless one is configured: two replicas collide with a chance of about 1 in 2 billion.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpuusage.api.times import parse_time

MAX_PRIORITY = 2**31 - 1


@dataclass(frozen=True)
class Peering:
    """This replica's place among its peers (absent when running standalone)."""

    name: str
    identity: str
    priority: int
    lifetime: int
    settle: float = 3.0
    """Seconds after start before the first decision: replicas started together touch the
    peering object at once, so by then each sees the others."""


def own_identity() -> str:
    """This replica's name among peers: the pod name (the hostname in a pod) and the pid."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}/{os.getpid()}"


def random_priority() -> int:
    return 1 + secrets.randbelow(MAX_PRIORITY - 1)


def live_peers(status: Mapping[str, Any], now: datetime) -> dict[str, int]:
    """identity → priority of the peers whose record has not expired (kopf's `is_dead`)."""
    peers: dict[str, int] = {}
    for identity, record in status.items():
        if not isinstance(record, Mapping):
            continue
        seen = parse_time(record.get("lastseen"))
        try:
            lifetime = timedelta(seconds=int(record.get("lifetime", 60)))
            priority = int(record.get("priority", 0))
        except (TypeError, ValueError):
            continue
        if seen is not None and seen + lifetime > now:
            peers[identity] = priority
    return peers


def is_active(status: Mapping[str, Any], identity: str, priority: int, now: datetime) -> bool:
    """Whether a replica may write: no other live peer has a priority ≥ its own."""
    return all(
        other < priority for peer, other in live_peers(status, now).items() if peer != identity
    )
