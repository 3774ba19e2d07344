"""Times as the Kubernetes API writes them (RFC 3339, UTC, whole seconds, a trailing "Z").

One pair of functions for every place that writes or reads such a time (conditions,
annotations, Leases), so that what is written compares equal to what is read back.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime


def format_time(moment: datetime) -> str:
    """2026-11-21T12:00:30Z."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(moment: datetime) -> str:
    """metav1.MicroTime as the apiserver writes it (a Lease's times): 2026-11-24T07:12:42.996470Z
    (microseconds required)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: object) -> datetime | None:
    """An API time (with "Z" or an offset); None for anything else, never an exception."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


Clock = Callable[[], datetime]
"""What every component that needs the time is given (tests pass a fixed or stepped one)."""


def utc_now() -> datetime:
    """The real clock: aware, UTC."""
    return datetime.now(UTC)
