"""`gpuusage top --by namespace --window` against a real Prometheus that asks who is calling:
Prometheus 3.5.0 built from its Go module (promtool's release), serving HTTPS with a CA of the
test's own and basic auth from its `--web.config.file`, its showback series loaded as TSDB
blocks by promtool. The bill comes through with the right credentials and CA, and every other
case is one line saying what was refused, with no traceback and no secret. A header is proven
by a recording TLS proxy in front of it (Prometheus ignores headers it does not know), and so
is a bearer token (Prometheus' own web config has basic auth only, so it refuses one)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuusage_commands.bill import RULES
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.localcluster.pki import create_pki
from gpuusage_dev.localprometheus import LocalPrometheus, running_prometheus
from tests.conftest import gpuusage_cli
from tests.headerproxy import HeaderProxy

NS = f"billed-{uuid.uuid4().hex[:5]}"
PER_MINUTE = {
    "handed": 2.0,
    "held": 1.0,
    "computing": 1.0,
    "compute": 0.5,
    "memory": 10240.0,
}
"""The showback rules' per-minute values of the namespace: two GPUs handed, one holding 10 GiB
and computing at half of its time."""
BILL = ["2.0", "1.0", "1.0", "0.5", "0.0", "10.0", "50%", "50%"]
"""Its bill over an hour (GPU-H, HELD-H, COMPUTING-H, COMPUTE-H, NO-SHARE-H, GIB-H and the two
efficiencies)."""


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPrometheus]:
    """The series a minute apart from three hours back to three hours ahead: an hour's window
    ending whenever a test asks holds sixty of them (Prometheus' ranges are open at the
    start), so the hours are exact."""
    minute = int(time.time()) // 60 * 60
    series = {f'{RULES[c][0]}{{namespace="{NS}"}}': v for c, v in PER_MINUTE.items()}
    times = range(minute - 3 * 3600, minute + 3 * 3600 + 1, 60)
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), series, times) as running:
        yield running


def _top(
    cluster: LocalCluster, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return gpuusage_cli(
        cluster.kubeconfig, "top", "--by", "namespace", "--window", "1h", *args, env=env
    )


def _billed(shown: subprocess.CompletedProcess[str]) -> list[str]:
    """The namespace's bill cells, the command having succeeded."""
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[1:-1]}
    return rows[NS][-8:]


def _refused(shown: subprocess.CompletedProcess[str], *secrets: str) -> str:
    """The one line of a refusal, the command having failed without a table, a traceback or
    a secret."""
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert shown.stdout == ""
    assert "Traceback" not in shown.stderr
    for secret in secrets:
        assert secret not in shown.stderr
    lines = shown.stderr.strip().splitlines()
    assert len(lines) == 1, shown.stderr
    return lines[0]


def test_the_bill_from_prometheus_behind_basic_auth_and_tls(
    cluster: LocalCluster, prometheus: LocalPrometheus, tmp_path: Path
) -> None:
    assert prometheus.pki is not None
    password = tmp_path / "password"
    password.write_text(prometheus.password + "\n")
    ca = str(prometheus.pki.ca_cert)
    login = ["--prometheus-user", prometheus.user, "--prometheus-password-file", str(password)]
    url = prometheus.url

    shown = _top(cluster, "--prometheus", url, *login, "--prometheus-ca-file", ca)
    assert _billed(shown) == BILL
    assert f"from the showback rules in Prometheus at {url}" in shown.stdout.splitlines()[-1]
    # The same from the environment variables.
    from_env = _top(
        cluster,
        env={
            "GPUUSAGE_PROMETHEUS": url,
            "GPUUSAGE_PROMETHEUS_USER": prometheus.user,
            "GPUUSAGE_PROMETHEUS_PASSWORD_FILE": str(password),
            "GPUUSAGE_PROMETHEUS_CA_FILE": ca,
        },
    )
    assert _billed(from_env) == BILL

    no_login = _top(cluster, "--prometheus", url, "--prometheus-ca-file", ca)
    assert _refused(no_login) == (
        f"gpuusage: Prometheus refused the credentials: 401 Unauthorized from {url} (no "
        "credentials; give --prometheus-token-file, or --prometheus-user and "
        "--prometheus-password-file): Unauthorized"
    )
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    wrong_login = ["--prometheus-user", prometheus.user, "--prometheus-password-file", str(wrong)]
    refused = _top(cluster, "--prometheus", url, *wrong_login, "--prometheus-ca-file", ca)
    assert _refused(refused, "not-the-password").startswith(
        f"gpuusage: Prometheus refused the credentials: 401 Unauthorized from {url} (basic "
        f"auth as user '{prometheus.user}')"
    )

    system_cas = _top(cluster, "--prometheus", url, *login)
    assert _refused(system_cas, prometheus.password) == (
        f"gpuusage: cannot verify Prometheus' TLS certificate at {url}: unable to get local "
        "issuer certificate (trusting the system's CAs; give the CA that signed it with "
        "--prometheus-ca-file)"
    )
    other = create_pki(tmp_path / "other-pki").ca_cert
    wrong_ca = _top(cluster, "--prometheus", url, *login, "--prometheus-ca-file", str(other))
    assert _refused(wrong_ca, prometheus.password) == (
        f"gpuusage: cannot verify Prometheus' TLS certificate at {url}: unable to get local "
        f"issuer certificate (trusting the CAs in {other}; give the CA that signed it with "
        "--prometheus-ca-file)"
    )
    missing = _top(cluster, "--prometheus", url, *login, "--prometheus-ca-file", "/no/ca.crt")
    assert _refused(missing) == "gpuusage: --prometheus-ca-file /no/ca.crt: no such file"


def test_headers_and_a_bearer_token_reach_prometheus(
    cluster: LocalCluster, prometheus: LocalPrometheus, tmp_path: Path
) -> None:
    pki = prometheus.pki
    assert pki is not None
    password = tmp_path / "password"
    password.write_text(prometheus.password)
    ca = str(pki.ca_cert)
    login = ["--prometheus-user", prometheus.user, "--prometheus-password-file", str(password)]
    with HeaderProxy(
        prometheus.url, pki.serving_cert, pki.serving_key, prometheus.trust()
    ) as proxy:
        shown = _top(
            cluster,
            "--prometheus",
            proxy.url,
            *login,
            "--prometheus-ca-file",
            ca,
            "--prometheus-header",
            "X-Scope-OrgID: tenant-a",
            "--prometheus-header",
            "X-Request-Source: gpuusage-bill",
        )
        assert _billed(shown) == BILL
        assert len(proxy.seen) == len(RULES), "one query a column"
        for heard in proxy.seen:
            assert heard["x-scope-orgid"] == "tenant-a"
            assert heard["x-request-source"] == "gpuusage-bill"
            assert heard["authorization"].startswith("Basic ")

        proxy.seen.clear()
        token = tmp_path / "token"
        token.write_text("s3cret-bearer-token\n")
        bearer = _top(
            cluster,
            "--prometheus",
            proxy.url,
            "--prometheus-token-file",
            str(token),
            "--prometheus-ca-file",
            ca,
            env={"GPUUSAGE_PROMETHEUS_HEADER": "X-Scope-OrgID: tenant-b"},
        )
        assert proxy.seen[0]["authorization"] == "Bearer s3cret-bearer-token"
        assert proxy.seen[0]["x-scope-orgid"] == "tenant-b"
        assert _refused(bearer, "s3cret-bearer-token") == (
            f"gpuusage: Prometheus refused the credentials: 401 Unauthorized from {proxy.url} "
            f"(a bearer token from {token}): Unauthorized"
        )
