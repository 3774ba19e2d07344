"""Certificates and keys for a local control plane, made with the openssl command.

One CA signs the apiserver's serving certificate (for 127.0.0.1, ::1 and localhost) and an
admin client certificate in group system:masters; an RSA key pair signs and verifies
service-account tokens. openssl does all of it in well under a second.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpuusage.errors import GpuusageError


class PkiError(GpuusageError):
    """openssl is missing or failed."""


@dataclass(frozen=True)
class Pki:
    """Paths of the files a local control plane is started with."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PkiError(
            "openssl not found on PATH; install it (Debian/Ubuntu: apt-get install openssl)"
        )
    proc = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PkiError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _signed(directory: Path, name: str, subject: str, extensions: str) -> None:
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        subject,
        cwd=directory,
    )
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-sha256",
        "-out",
        f"{name}.crt",
        "-extfile",
        f"{name}.ext",
        cwd=directory,
    )


def create_pki(directory: Path) -> Pki:
    """Create a fresh CA, serving and admin certificates and a service-account key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-sha256",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=gpuusage-local-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    _signed(
        directory,
        "apiserver",
        "/CN=kube-apiserver",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,IP:::1,IP:10.0.0.1,"
        "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n",
    )
    _signed(
        directory,
        "admin",
        "/O=system:masters/CN=gpuusage-admin",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
    )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=directory)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )


CLIENT_EXTENSIONS = (
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    "extendedKeyUsage=clientAuth\n"
)


def client_certificate(directory: Path, name: str, subject: str) -> tuple[Path, Path]:
    """A client certificate of the local CA in `directory` (made once): (certificate, key)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    if not (cert.exists() and key.exists()):
        _signed(directory, name, subject, CLIENT_EXTENSIONS)
        key.chmod(0o600)
    return cert, key
