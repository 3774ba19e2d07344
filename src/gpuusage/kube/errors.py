"""API errors as our own small hierarchy, and one bounded retry helper.

Every call site asks one question of a failure: try again soon (connection refused, timeout,
5xx, 429), or not (403, 404, 409, 422 need a decision). The original exception is chained and
the apiserver's Status message is kept, so logs say what the server said.

This module does not import the `kubernetes` package (the agent avoids it for its memory
footprint); the client's ApiException is recognised by its attributes.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from gpuusage.retry import Backoff

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_BACKOFF = Backoff((0.2, 0.5, 1.0, 2.0), jitter=0.2)
TOO_LARGE = "request is too large"  # etcd's words, as the apiserver passes them on


class ApiError(Exception):
    """A failed API call; `status` is the HTTP status (None when no answer came)."""

    def __init__(self, message: str, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class TransientApiError(ApiError):
    """Worth retrying: no answer, a timeout, 429 or 5xx."""


class NotFound(ApiError):
    """404."""


class Conflict(ApiError):
    """409: already exists, or the object changed under us."""


class Forbidden(ApiError):
    """401/403: RBAC or an admission policy said no."""


class Invalid(ApiError):
    """422 or 400: the object was refused; the message says which field."""


class TooLarge(ApiError):
    """413 (the apiserver's 3 MiB body limit) or etcd's "request is too large" (its 1.5 MiB
    limit, which the apiserver passes on as a 500): this body will never be stored, so it is
    not retried."""


class NotLeading(ApiError):
    """A write the operator did not send: this replica does not lead now (never retried;
    the replica that leads writes instead)."""


def is_permanent_for_body(error: ApiError) -> bool:
    """Whether sending the same body again can only fail the same way."""
    return isinstance(error, Invalid | TooLarge)


def is_other_object(error: ApiError) -> bool:
    """Whether a write was refused because the object under that name has another UID than
    the one the write carried: it was deleted and recreated meanwhile."""
    return isinstance(error, Invalid) and "metadata.uid" in str(error)


_KINDS: dict[int, type[ApiError]] = {
    404: NotFound,
    409: Conflict,
    401: Forbidden,
    403: Forbidden,
    422: Invalid,
    400: Invalid,
}


def from_status(status: int | None, body: bytes | str | None, fallback: str = "") -> ApiError:
    """The error for an HTTP status and the apiserver's Status body."""
    try:
        parsed = json.loads(body or "{}")
    except (ValueError, TypeError):
        parsed = {}
    if not isinstance(parsed, dict):
        parsed = {}
    message = str(parsed.get("message") or fallback)
    reason = str(parsed.get("reason") or "")
    text = f"{status} {reason or fallback}: {message}".strip()
    if status == 413 or (status is not None and status >= 500 and TOO_LARGE in message):
        return TooLarge(text, status, reason)
    if status is None or status in {0, 429} or status >= 500:
        return TransientApiError(text, status, reason)
    return _KINDS.get(status, ApiError)(text, status, reason)


def _is_api_exception(exc: BaseException) -> bool:
    """The kubernetes client's ApiException or one of its subclasses (NotFoundException,
    UnprocessableEntityException, ...), recognised without importing the package."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "ApiException" in names and hasattr(exc, "status")


def translate(exc: BaseException) -> ApiError:
    """Map a client exception to our hierarchy."""
    if isinstance(exc, ApiError):
        return exc
    if _is_api_exception(exc):
        return from_status(
            getattr(exc, "status", None),
            getattr(exc, "body", None),
            str(getattr(exc, "reason", "") or ""),
        )
    if isinstance(exc, OSError | TimeoutError) or type(exc).__module__.startswith("urllib3"):
        return TransientApiError(f"no answer from the API: {exc}")
    return ApiError(str(exc))


def retried(
    fn: Callable[[], T],
    what: str,
    backoff: Backoff = DEFAULT_BACKOFF,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run fn; retry transient failures along `backoff`; raise ApiError.

    The attempts are bounded: callers that must never give up (the agent's loop) call again on
    their next cycle, with the newest data, rather than retrying stale data forever.
    """
    attempts = backoff.attempts
    for attempt in itertools.count(1):
        try:
            return fn()
        except Exception as exc:
            if not (
                isinstance(exc, ApiError | OSError | TimeoutError)
                or _is_api_exception(exc)
                or type(exc).__module__.startswith("urllib3")
            ):
                raise
            error = translate(exc)
            delay = backoff.delay(attempt - 1) if isinstance(error, TransientApiError) else None
            if delay is None:
                if error is exc:
                    raise
                raise error from exc
            log.warning(
                "%s: %s (attempt %d/%s, retrying in %.1fs)",
                what,
                error,
                attempt,
                attempts or "unbounded",
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
