"""A policy's announcement on a pod: the gpuusage.io/policy-action annotation, which says what
will happen to the pod, under which policy, and when. Written by the operator, read back by
it (deadlines survive restarts and handovers) and by `gpuusage top` (the pending action)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from gpuusage.api.times import format_time, parse_time


@dataclass(frozen=True)
class Announcement:
    """What the pod's gpuusage.io/policy-action annotation holds."""

    policy: str
    finding: str
    action: str
    mode: str
    after: str
    since: datetime
    """When the finding began (as far as the operator knows)."""
    due: datetime
    recorded: bool = False
    """The due step was taken for good (a dry run recorded, the action done or refused for
    good): it is not taken again. An action that failed and is to be retried leaves it
    unset."""


def encode(announcement: Announcement) -> str:
    """The gpuusage.io/policy-action annotation's value: compact JSON a person can read."""
    doc: dict[str, object] = {
        "policy": announcement.policy,
        "finding": announcement.finding,
        "action": announcement.action,
        "mode": announcement.mode,
        "after": announcement.after,
        "since": format_time(announcement.since),
        "due": format_time(announcement.due),
    }
    if announcement.recorded:
        doc["recorded"] = True
    return json.dumps(doc, separators=(",", ":"))


def decode(text: str | None) -> Announcement | None:
    """The announcement an annotation holds; None when absent or not one of ours (a hand edit
    that cannot be read is replaced by a fresh announcement, never acted upon)."""
    if not text:
        return None
    try:
        doc = json.loads(text)
        since, due = parse_time(doc["since"]), parse_time(doc["due"])
        policy, finding, action, mode, after = (
            str(doc[k]) for k in ("policy", "finding", "action", "mode", "after")
        )
    except (ValueError, KeyError, TypeError):
        return None
    if since is None or due is None:
        return None
    recorded = doc.get("recorded") is True
    return Announcement(policy, finding, action, mode, after, since, due, recorded)
