"""kopf's own request loop, driven with the operator's backoff setting: an API that answers 503
for longer than kopf's default backoffs last is retried until it answers. kopf's one use of it
in the operator is its discovery at start (it watches nothing: kopfsetup); with kopf's defaults
the ninth failure escalates and the operator exits, as a report watch kopf once ran stopped for
good after several apiserver restarts in a row (benchmarks/README.md, fault soak)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import aiohttp
import kopf
import pytest
from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import errors as kopf_errors

from gpuusage_operator.kopfsetup import configure_kopf


class Answer:
    """Just enough of aiohttp's response for kopf's check_response."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.headers: dict[str, str] = {}

    async def json(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "message": "the request has been made before all known HTTP "
            "paths have been installed, please try again",
            "code": self.status,
        }

    async def text(self) -> str:
        return ""

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise aiohttp.ClientResponseError(None, (), status=self.status)  # type: ignore[arg-type]


class Session:
    """Answers 503 `failures` times, then 200."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls, self.closed = failures, 0, False

    async def request(self, **_: Any) -> Answer:
        self.calls += 1
        return Answer(503 if self.calls <= self.failures else 200)


def _request(backoffs: Any, session: Session) -> Any:
    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = backoffs
    context: Any = SimpleNamespace(
        server="https://127.0.0.1:1", session=session, add_response=lambda response: None
    )
    return asyncio.run(
        kopf_api.request(
            method="get",
            url="/apis/gpuusage.io/v1alpha1/gpunodeusages",
            settings=settings,
            logger=logging.getLogger("test"),
            context=context,
        )
    )


def test_the_operators_backoffs_outlast_any_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def no_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("kopf._cogs.clients.api.asyncio.sleep", no_sleep)
    settings = kopf.OperatorSettings()
    configure_kopf(settings)
    session = Session(failures=30)
    answer = _request(settings.networking.error_backoffs, session)
    assert answer.status == 200
    assert session.calls == 31
    steps = [1, 1, 2, 3, 5] + [10] * 25  # then every 10 s, for as long as it takes
    assert len(slept) == len(steps)
    assert all(b / 2 <= s <= b for s, b in zip(slept, steps, strict=True)), "jittered below"
    # kopf's own defaults give up on the ninth failure: the reason for the setting.
    with pytest.raises(kopf_errors.APIServerError):
        _request(kopf.OperatorSettings().networking.error_backoffs, Session(failures=30))


def test_kopf_watches_nothing_and_posts_nothing() -> None:
    """No resource handler is registered, so kopf's observation of CRDs (and the rights it
    needs) would serve nothing; the operator's install grants none."""
    settings = kopf.OperatorSettings()
    configure_kopf(settings)
    assert settings.scanning.disabled
    assert not settings.posting.enabled
