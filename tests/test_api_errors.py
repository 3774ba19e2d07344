"""API errors mapped to the project's hierarchy, and the backoffs that retry them."""

from __future__ import annotations

import itertools

import pytest
import urllib3
from kubernetes.client import exceptions
from kubernetes.client.exceptions import ApiException

from gpuusage.kube.errors import (
    ApiError,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    TransientApiError,
    retried,
)
from gpuusage.retry import Backoff, doubling


def _api_exception(status: int, message: str = "boom") -> ApiException:
    exc = ApiException(status=status, reason="R")
    exc.body = f'{{"kind":"Status","message":"{message}","reason":"X"}}'
    return exc


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (404, NotFound),
        (409, Conflict),
        (403, Forbidden),
        (422, Invalid),
        (500, TransientApiError),
        (503, TransientApiError),
        (429, TransientApiError),
    ],
)
def test_errors_map_to_our_hierarchy(status: int, kind: type[Exception]) -> None:
    def fail() -> None:
        raise _api_exception(status, "the server said so")

    with pytest.raises(kind, match="the server said so"):
        retried(fail, "test", backoff=Backoff((0.0,)), sleep=lambda _: None)


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (exceptions.NotFoundException, NotFound),
        (exceptions.ConflictException, Conflict),
        (exceptions.ForbiddenException, Forbidden),
        (exceptions.UnprocessableEntityException, Invalid),
        (exceptions.ServiceException, TransientApiError),
    ],
)
def test_the_clients_own_subclasses_map_to_our_hierarchy_too(
    raised: type[ApiException], kind: type[ApiError]
) -> None:
    """The client raises NotFoundException and friends, not ApiException itself: a 404 that
    escapes `except NotFound` would count a deleted pod as an API failure."""
    status = {NotFound: 404, Conflict: 409, Forbidden: 403, Invalid: 422}.get(kind, 503)

    def fail() -> None:
        exc = raised(status=status, reason="R")
        exc.body = '{"kind":"Status","message":"the server said so","reason":"X"}'
        raise exc

    with pytest.raises(kind, match="the server said so"):
        retried(fail, "test", backoff=Backoff((0.0,)), sleep=lambda _: None)


def test_transient_errors_are_retried_with_bounded_backoff() -> None:
    attempts: list[int] = []
    sleeps: list[float] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]
        return "ok"

    assert retried(flaky, "test", backoff=Backoff((1.0, 2.0, 4.0)), sleep=sleeps.append) == "ok"
    assert len(attempts) == 3
    assert 0.5 <= sleeps[0] <= 1.0, "jittered below the step"
    assert 1.0 <= sleeps[1] <= 2.0

    def down() -> None:
        raise _api_exception(503)

    sleeps.clear()
    with pytest.raises(TransientApiError):
        retried(down, "test", backoff=Backoff((1.0, 2.0)), sleep=sleeps.append)
    assert len(sleeps) == 2, "bounded: no endless retry"


def test_permanent_errors_are_not_retried() -> None:
    sleeps: list[float] = []

    def forbidden() -> None:
        raise _api_exception(403)

    with pytest.raises(Forbidden):
        retried(forbidden, "test", backoff=Backoff((1.0, 2.0)), sleep=sleeps.append)
    assert sleeps == []


def test_backoffs_give_up_after_their_steps_or_go_on_forever_capped() -> None:
    bounded = Backoff((1.0, 2.0), jitter=0.0)
    assert (list(bounded), bounded.attempts) == ([1.0, 2.0], 3)
    forever = doubling(1.0, 5.0)
    assert forever.attempts is None
    first = list(itertools.islice(iter(forever), 6))
    assert all(a <= b for a, b in zip([0.5, 1.0, 2.0, 2.5, 2.5, 2.5], first, strict=True))
    assert all(b <= a for a, b in zip([1.0, 2.0, 4.0, 5.0, 5.0, 5.0], first, strict=True))
