"""The access to a Prometheus that asks who is calling (`gpuusage top --window`'s
--prometheus-token-file, --prometheus-user and --prometheus-password-file,
--prometheus-ca-file, --prometheus-header): what the flags and their variables become, and a
clear refusal, naming the flag and never the secret, of everything that cannot work. The
requests they make are in test_bill.py (a stand-in) and test_bill_on_prometheus.py (the real
Prometheus)."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path

import pytest

from gpuusage.cli import build_parser
from gpuusage.errors import GpuusageError
from gpuusage.settings import resolve
from gpuusage_commands.promaccess import (
    headers_of,
    parse_header,
    prometheus_access,
    read_flag_file,
)
from gpuusage_commands.prometheus import NO_ACCESS, PrometheusError, base_url
from gpuusage_commands.top import TopSettings, _checked
from gpuusage_dev.localcluster.pki import create_pki


def test_a_header_is_a_name_and_a_value() -> None:
    assert parse_header("X-Scope-OrgID: tenant-a") == ("X-Scope-OrgID", "tenant-a")
    assert parse_header("  X-Scope-OrgID:tenant-a|tenant-b ") == (
        "X-Scope-OrgID",
        "tenant-a|tenant-b",
    )
    assert parse_header("X-Api: a:b") == ("X-Api", "a:b"), "the first colon splits"
    for bad in ("X-Scope-OrgID tenant-a", ": tenant-a", "X Scope: a", "Tenant(a): b"):
        with pytest.raises(PrometheusError, match=r"write it as 'Name: value'"):
            parse_header(bad)
    with pytest.raises(PrometheusError, match="the value is empty"):
        parse_header("X-Scope-OrgID: ")  # "X-Scope-OrgID: $TENANT" with TENANT unset
    with pytest.raises(PrometheusError, match="a header is one line"):
        parse_header("X-Scope-OrgID: a\r\nX-Evil: b")


def test_credentials_never_come_in_a_header_on_the_command_line() -> None:
    for name in ("Authorization", "authorization", "Proxy-Authorization"):
        with pytest.raises(PrometheusError, match="--prometheus-token-file") as refused:
            parse_header(f"{name}: Bearer s3cret")
        assert "s3cret" not in str(refused.value)


def test_a_header_given_twice_is_refused() -> None:
    assert headers_of(["X-Scope-OrgID: a", "X-Other: b"]) == (
        ("X-Scope-OrgID", "a"),
        ("X-Other", "b"),
    )
    with pytest.raises(PrometheusError, match="given twice"):
        headers_of(["X-Scope-OrgID: a", "x-scope-orgid: b"])


def test_a_secret_file_that_cannot_serve_is_named_not_shown(tmp_path: Path) -> None:
    flag = "--prometheus-token-file"
    (tmp_path / "token").write_text("  s3cret\n")
    assert read_flag_file(tmp_path / "token", flag) == "s3cret", "white space dropped"
    with pytest.raises(PrometheusError, match=f"{flag} .*/absent: no such file"):
        read_flag_file(tmp_path / "absent", flag)
    with pytest.raises(PrometheusError, match="a folder, not a file"):
        read_flag_file(tmp_path, flag)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(PrometheusError, match="the file is empty"):
        read_flag_file(tmp_path / "empty", flag)
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00s3cret")
    with pytest.raises(PrometheusError, match=r"not text \(UTF-8\)"):
        read_flag_file(tmp_path / "binary", flag)


def test_a_bearer_token_and_basic_auth_become_the_authorization_header(tmp_path: Path) -> None:
    token, password = tmp_path / "token", tmp_path / "password"
    token.write_text("eyJ.tok.en\n")
    password.write_text("pa ss:word\n")
    bearer = prometheus_access(token_file=token, headers=["X-Scope-OrgID: a"])
    assert bearer.headers == (("Authorization", "Bearer eyJ.tok.en"), ("X-Scope-OrgID", "a"))
    assert bearer.credentials == f"a bearer token from {token}"
    assert bearer.context is None, "the system's CAs"
    basic = prometheus_access(user="alice", password_file=password)
    assert basic.headers == (
        ("Authorization", "Basic " + base64.b64encode(b"alice:pa ss:word").decode()),
    )
    assert basic.credentials == "basic auth as user 'alice'"
    assert prometheus_access() == NO_ACCESS
    assert prometheus_access(headers=["X-Scope-OrgID: a"]).credentials == "no credentials"


def test_what_cannot_be_credentials_is_refused(tmp_path: Path) -> None:
    token, password = tmp_path / "token", tmp_path / "password"
    token.write_text("s3cret s3cret")
    password.write_text("s3cret")
    with pytest.raises(PrometheusError, match="more than one word") as refused:
        prometheus_access(token_file=token)
    assert "s3cret" not in str(refused.value)
    with pytest.raises(PrometheusError, match="not both"):
        prometheus_access(token_file=token, user="alice", password_file=password)
    with pytest.raises(PrometheusError, match="needs both --prometheus-user and"):
        prometheus_access(user="alice")
    with pytest.raises(PrometheusError, match="needs both --prometheus-user and"):
        prometheus_access(password_file=password)
    with pytest.raises(PrometheusError, match="no colon"):
        prometheus_access(user="al:ice", password_file=password)


def test_a_ca_bundle_is_trusted_alone(tmp_path: Path) -> None:
    pki = create_pki(tmp_path / "pki")
    access = prometheus_access(ca_file=pki.ca_cert)
    assert isinstance(access.context, ssl.SSLContext)
    assert access.context.verify_mode == ssl.CERT_REQUIRED
    assert access.context.check_hostname
    assert [c["subject"] for c in access.context.get_ca_certs()] == [
        ((("commonName", "gpuusage-local-ca"),),)
    ], "its CA alone, not the system's"
    assert access.trusted == f"the CAs in {pki.ca_cert}"
    with pytest.raises(PrometheusError, match=r"--prometheus-ca-file .*: no PEM certificate"):
        prometheus_access(ca_file=pki.serving_key)
    with pytest.raises(PrometheusError, match=r"--prometheus-ca-file .*: no such file"):
        prometheus_access(ca_file=tmp_path / "absent.crt")


def test_a_url_with_a_password_in_it_is_refused() -> None:
    with pytest.raises(PrometheusError, match="--prometheus-password-file") as refused:
        base_url("https://alice:s3cret@thanos.example.com")
    assert "s3cret" not in str(refused.value)


def test_the_flags_and_their_variables(tmp_path: Path) -> None:
    """A header flag given twice is two headers; its variable holds one a line; the files
    are read only for a bill, before anyone is asked anything."""
    parser = build_parser()
    words = ["top", "--prometheus-header", "X-A: 1", "--prometheus-header", "X-B: 2"]
    given = resolve(TopSettings, parser.parse_args(words), environ={})
    assert given.prometheus_header == ("X-A: 1", "X-B: 2")
    from_env = resolve(
        TopSettings,
        parser.parse_args(["top"]),
        environ={
            "GPUUSAGE_PROMETHEUS_HEADER": "X-A: 1\n\nX-B: 2\n",
            "GPUUSAGE_PROMETHEUS_USER": "alice",
            "GPUUSAGE_PROMETHEUS_PASSWORD_FILE": str(tmp_path / "password"),
            "GPUUSAGE_PROMETHEUS_CA_FILE": str(tmp_path / "ca.crt"),
            "GPUUSAGE_PROMETHEUS_TOKEN_FILE": str(tmp_path / "token"),
        },
    )
    assert from_env.prometheus_header == ("X-A: 1", "X-B: 2")
    assert from_env.prometheus_user == "alice"
    assert from_env.prometheus_password_file == tmp_path / "password"
    assert from_env.prometheus_ca_file == tmp_path / "ca.crt"
    assert from_env.prometheus_token_file == tmp_path / "token"
    flag_wins = resolve(
        TopSettings,
        parser.parse_args(["top", "--prometheus-header", "X-C: 3"]),
        environ={"GPUUSAGE_PROMETHEUS_HEADER": "X-A: 1"},
    )
    assert flag_wins.prometheus_header == ("X-C: 3",)
    # Without --window nothing is read: a variable set for the bill does not stop `top`.
    assert _checked(from_env) == NO_ACCESS
    billed = from_env.model_copy(
        update={"window": "24h", "by": "namespace", "prometheus": "https://p:9090"}
    )
    with pytest.raises(GpuusageError, match="not both"):
        _checked(billed)
    with pytest.raises(GpuusageError, match="--prometheus-header 'X-A 1'"):
        _checked(
            TopSettings(
                window="24h",
                by="namespace",
                prometheus="https://p:9090",
                prometheus_header=("X-A 1",),
            )
        )
