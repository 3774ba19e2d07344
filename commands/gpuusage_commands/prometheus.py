"""Instant queries to Prometheus' HTTP API (`GET /api/v1/query`), for `gpuusage top`'s bill.

Standard library only, with a timeout on every request: a command must never hang on a
monitoring system that does not answer. Every failure becomes one message saying where and
what (unreachable, refused, not Prometheus), never a traceback.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from gpuusage.errors import GpuusageError

TIMEOUT_S = 30.0


class PrometheusError(GpuusageError):
    """Prometheus could not be asked, or did not answer as Prometheus does."""


def base_url(url: str) -> str:
    """The URL queries go under; a clear error for one that is not http(s)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise PrometheusError(
            f"--prometheus {url!r}: give Prometheus' base URL, e.g. http://localhost:9090 "
            "(kubectl -n monitoring port-forward svc/prometheus-operated 9090)"
        )
    return url.rstrip("/")


def instant_query(
    url: str, expr: str, at: float | None = None, timeout: float = TIMEOUT_S
) -> Mapping[str, Any]:
    """Prometheus' answer to one instant query at `at` (Unix seconds; now when None)."""
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    target = f"{base_url(url)}/api/v1/query?{urllib.parse.urlencode(params)}"
    request = urllib.request.Request(target, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:  # Prometheus says why in its JSON body
        body = exc.read()
        detail = _error_of(body) or f"{exc.code} {exc.reason}"
        raise PrometheusError(f"Prometheus at {url} refused the query: {detail}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PrometheusError(f"cannot reach Prometheus at {url}: {reason}") from exc
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PrometheusError(
            f"{url} did not answer as Prometheus' API does (not JSON): is it Prometheus?"
        ) from exc
    if not isinstance(parsed, dict):
        raise PrometheusError(f"{url} did not answer as Prometheus' API does: {parsed!r:.80}")
    return parsed


def _error_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return str(parsed.get("error")) if isinstance(parsed, dict) and parsed.get("error") else None
