"""Instant queries to Prometheus' HTTP API (`GET /api/v1/query`), for `gpuusage top`'s bill.

Standard library only, with a timeout on every request: a command must never hang on a
monitoring system that does not answer. Every failure becomes one message saying where and
what (unreachable, credentials refused, a certificate not trusted, refused, not Prometheus),
never a traceback, and never a secret.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuusage.errors import GpuusageError

TIMEOUT_S = 30.0


class PrometheusError(GpuusageError):
    """Prometheus could not be asked, or did not answer as Prometheus does."""


@dataclass(frozen=True)
class Access:
    """What every request to Prometheus carries, and whom it trusts (promaccess makes one
    from the flags)."""

    headers: tuple[tuple[str, str], ...] = ()
    """Sent on every request (the credentials' Authorization among them), never on a
    redirect: it may lead elsewhere."""
    context: ssl.SSLContext | None = None
    """The TLS trust of --prometheus-ca-file; None: the system's CAs."""
    trusted: str = "the system's CAs"
    """Whom `context` trusts, as a person may read it."""
    credentials: str = "no credentials"
    """What was sent to prove who is calling, as a person may read it: never the secret."""


NO_ACCESS = Access()
CREDENTIAL_FLAGS = "--prometheus-token-file, or --prometheus-user and --prometheus-password-file"


def base_url(url: str) -> str:
    """The URL queries go under; a clear error for one that is not http(s)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise PrometheusError(
            f"--prometheus {url!r}: give Prometheus' base URL, e.g. http://localhost:9090 "
            "(kubectl -n monitoring port-forward svc/prometheus-operated 9090)"
        )
    if parsed.username is not None or parsed.password is not None:
        raise PrometheusError(
            "--prometheus: a user or password in the URL is refused (it would be on the command "
            f"line); give the URL without it, and {CREDENTIAL_FLAGS}"
        )
    return url.rstrip("/")


def instant_query(
    url: str,
    expr: str,
    at: float | None = None,
    timeout: float = TIMEOUT_S,
    access: Access = NO_ACCESS,
) -> Mapping[str, Any]:
    """Prometheus' answer to one instant query at `at` (Unix seconds; now when None)."""
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    target = f"{base_url(url)}/api/v1/query?{urllib.parse.urlencode(params)}"
    request = urllib.request.Request(target, headers={"Accept": "application/json"})
    for name, value in access.headers:
        request.add_unredirected_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=access.context) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:  # Prometheus says why in its JSON body
        body = exc.read()
        if exc.code in (401, 403):
            moved = exc.url.split("?", 1)[0] if exc.url != target else None
            answer = refused(url, exc.code, str(exc.reason), body, access, moved=moved)
            raise PrometheusError(answer) from None
        detail = _error_of(body) or f"{exc.code} {exc.reason}"
        raise PrometheusError(f"Prometheus at {url} refused the query: {detail}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise PrometheusError(untrusted(url, reason, access)) from None
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


def refused(
    url: str, code: int, reason: str, body: bytes, access: Access, *, moved: str | None = None
) -> str:
    """What a 401 or 403 means: what was sent (never the secret), what the server said, and
    a redirect on the way (which drops the credentials)."""
    said = body.decode("utf-8", "replace").strip().splitlines()
    detail = f": {said[0][:200]}" if said else ""
    sent = access.credentials
    if sent == NO_ACCESS.credentials:
        sent = f"{sent}; give {CREDENTIAL_FLAGS}"
    elif moved:
        sent = f"{sent}, not sent on the redirect to {moved}: give that URL"
    return f"Prometheus refused the credentials: {code} {reason} from {url} ({sent}){detail}"


def untrusted(url: str, error: ssl.SSLCertVerificationError, access: Access) -> str:
    """A certificate that does not verify: why, and which trust was used."""
    return (
        f"cannot verify Prometheus' TLS certificate at {url}: {error.verify_message} "
        f"(trusting {access.trusted}; give the CA that signed it with --prometheus-ca-file)"
    )


def _error_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return str(parsed.get("error")) if isinstance(parsed, dict) and parsed.get("error") else None
