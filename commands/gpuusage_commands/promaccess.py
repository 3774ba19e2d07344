"""How `gpuusage top --window` reaches a Prometheus that asks who is calling.

The Prometheus of a fleet is often a Thanos, Mimir or managed Prometheus behind a bearer token
or basic auth, on TLS signed by a private CA, and a multi-tenant one wants the tenant in a
header (`X-Scope-OrgID`). Secrets come from files only: a command line is visible to every
user of the machine (`ps`) and stays in shell histories. The files are read once, before the
command asks anyone anything, and every problem with them is one message naming the flag and
the file, never their content.
"""

from __future__ import annotations

import base64
import re
import ssl
from collections.abc import Sequence
from pathlib import Path

from gpuusage_commands.prometheus import CREDENTIAL_FLAGS, NO_ACCESS, Access, PrometheusError

HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
"""A header name as HTTP allows one (RFC 9110's token)."""


def parse_header(text: str) -> tuple[str, str]:
    """`Name: value` as a header (name, value); a clear error for anything else, and for an
    Authorization header, whose secret would be on the command line."""
    name, colon, value = text.partition(":")
    name, value = name.strip(), value.strip()
    shape = "write it as 'Name: value', e.g. 'X-Scope-OrgID: tenant-a'"
    if not colon or not HEADER_NAME.match(name):
        raise PrometheusError(f"--prometheus-header {text!r}: {shape}")
    if not value:
        raise PrometheusError(f"--prometheus-header {text!r}: the value is empty; {shape}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise PrometheusError(
            f"--prometheus-header {name!r}: the value holds a control character (a line "
            "break?); a header is one line"
        )
    if name.lower() in ("authorization", "proxy-authorization"):
        raise PrometheusError(
            f"--prometheus-header {name}: give the credentials from a file with "
            f"{CREDENTIAL_FLAGS} (a command line is visible to every user of the machine)"
        )
    return name, value


def headers_of(texts: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Every --prometheus-header, parsed; a name given twice is refused (the second would
    silently replace the first)."""
    parsed = tuple(parse_header(text) for text in texts)
    seen: set[str] = set()
    for name, _value in parsed:
        if name.lower() in seen:
            several = (
                " (Mimir takes several tenants in one: 'X-Scope-OrgID: tenant-a|tenant-b')"
                if name.lower() == "x-scope-orgid"
                else ""
            )
            raise PrometheusError(
                f"--prometheus-header {name} is given twice: give it once{several}"
            )
        seen.add(name.lower())
    return parsed


def read_flag_file(path: Path, flag: str) -> str:
    """What the file a flag names holds (a secret, or a CA bundle), surrounding white space
    dropped as Prometheus' own clients drop it; a clear error for a file that is missing,
    unreadable, empty or not text, which never quotes it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PrometheusError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise PrometheusError(f"{flag} {path}: a folder, not a file") from None
    except PermissionError:
        raise PrometheusError(f"{flag} {path}: cannot be read (permission denied)") from None
    except UnicodeDecodeError:
        raise PrometheusError(f"{flag} {path}: not text (UTF-8)") from None
    except OSError as exc:
        raise PrometheusError(f"{flag} {path}: cannot be read ({exc.strerror})") from None
    secret = text.strip()
    if not secret:
        raise PrometheusError(f"{flag} {path}: the file is empty")
    return secret


def bearer(token: str, path: Path) -> tuple[tuple[str, str], str]:
    """The Authorization header of a bearer token, and what it says of itself."""
    if any(c.isspace() or ord(c) < 32 for c in token):
        raise PrometheusError(
            f"--prometheus-token-file {path}: holds more than one word; the file holds the "
            "token alone"
        )
    return ("Authorization", f"Bearer {token}"), f"a bearer token from {path}"


def basic(user: str, password: str) -> tuple[tuple[str, str], str]:
    """The Authorization header of basic auth (RFC 7617), and what it says of itself."""
    if ":" in user or any(ord(c) < 32 for c in user):
        raise PrometheusError(
            f"--prometheus-user {user!r}: basic auth allows no colon or control character "
            "in a user name"
        )
    encoded = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return ("Authorization", f"Basic {encoded}"), f"basic auth as user {user!r}"


def trust(path: Path) -> ssl.SSLContext:
    """A TLS context that trusts the CA bundle's certificates alone (as Prometheus' own
    `ca_file` and kubectl's `certificate-authority` do), host names checked."""
    text = read_flag_file(path, "--prometheus-ca-file")
    try:
        return ssl.create_default_context(cadata=text)
    except ssl.SSLError as exc:
        raise PrometheusError(
            f"--prometheus-ca-file {path}: no PEM certificate could be read from it "
            f"({exc.reason or exc})"
        ) from None


def prometheus_access(
    *,
    token_file: Path | None = None,
    user: str | None = None,
    password_file: Path | None = None,
    ca_file: Path | None = None,
    headers: Sequence[str] = (),
) -> Access:
    """The access the flags describe, every file read and checked now."""
    if token_file is not None and (user is not None or password_file is not None):
        raise PrometheusError(
            "--prometheus-token-file and --prometheus-user: give a bearer token or basic auth, "
            "not both"
        )
    if (user is None) != (password_file is None):
        raise PrometheusError(
            "basic auth needs both --prometheus-user and --prometheus-password-file "
            "(a file holding the password: never the password itself on the command line)"
        )
    extra = headers_of(headers)
    credentials = NO_ACCESS.credentials
    if token_file is not None:
        header, credentials = bearer(
            read_flag_file(token_file, "--prometheus-token-file"), token_file
        )
        extra = (header, *extra)
    elif user is not None and password_file is not None:
        password = read_flag_file(password_file, "--prometheus-password-file")
        header, credentials = basic(user, password)
        extra = (header, *extra)
    if ca_file is None:
        return Access(headers=extra, credentials=credentials)
    return Access(extra, trust(ca_file), f"the CAs in {ca_file}", credentials)
