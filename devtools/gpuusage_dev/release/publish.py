"""A built release published to a registry: each image index pushed by crane as
`REGISTRY/<image>:<version>` and read back to the digest it was built with; signed with cosign;
each platform's SBOM attached to that platform's manifest and the provenance to the index, as
signed attestations (cosign's own types, `spdxjson` and `slsaprovenance1`).

Signing here is with a key pair: `COSIGN_KEY` names the private key (`COSIGN_PASSWORD` its
password), or, without it, a pair is generated into `dist/` and the build says so. A key pair
signs without a transparency log (an empty signing config); verify with
`cosign verify --key cosign.pub --insecure-ignore-tlog=true`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.release.images import Built, short_name


class PublishError(GpuusageError):
    """A push, signature or attestation failed, or the registry holds another digest."""


@dataclass(frozen=True)
class Signer:
    """A cosign key pair and how to sign without a transparency log."""

    key: Path
    public: Path
    password: str
    config: Path
    """An empty signing config: no transparency log, no timestamp authority."""


def _run(program: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
    try:
        ran = subprocess.run(
            [str(program), *args],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
    except subprocess.TimeoutExpired as error:
        raise PublishError(f"{program.name} {' '.join(args[:2])} took over 600 s") from error
    if ran.returncode != 0:
        said = "\n".join(line for line in ran.stderr.splitlines() if "WARNING" not in line)
        raise PublishError(f"{program.name} {' '.join(args[:2])} failed:\n{said[-2000:]}")
    return ran.stdout


def signer(cosign: Path, dist: Path, env: Mapping[str, str]) -> tuple[Signer, bool]:
    """The key pair to sign with: $COSIGN_KEY, else `dist`'s own (kept: a key users may
    already trust is never replaced), else one generated into `dist` (True: made now, and the
    caller says so)."""
    dist.mkdir(parents=True, exist_ok=True)
    config = dist / "signing-config.json"
    _run(cosign, "signing-config", "create", "--out", str(config))
    given = env.get("COSIGN_KEY")
    password = env.get("COSIGN_PASSWORD", "")
    if given:
        key = Path(given)
        if not key.is_file():
            raise PublishError(f"COSIGN_KEY={given} is not a file: a cosign private key")
        public = dist / "cosign.pub"
        public.write_text(
            _run(cosign, "public-key", "--key", str(key), env={"COSIGN_PASSWORD": password})
        )
        return Signer(key, public, password, config), False
    if (dist / "cosign.key").is_file() and (dist / "cosign.pub").is_file():
        return Signer(dist / "cosign.key", dist / "cosign.pub", password, config), False
    _run(
        cosign,
        "generate-key-pair",
        "--output-key-prefix",
        str(dist / "cosign"),
        env={"COSIGN_PASSWORD": password},
    )
    return Signer(dist / "cosign.key", dist / "cosign.pub", password, config), True


def push(crane: Path, one: Built, registry: str, version: str) -> str:
    """Push the image's index as `registry/<image>:<version>`: the reference by digest, once
    the registry answers with the digest it was built with."""
    short = short_name(one.name)
    tagged = f"{registry}/{short}:{version}"
    try:
        there = _run(crane, "digest", tagged).strip()
    except PublishError:
        there = ""  # not pushed yet
    if there and there != one.digest:
        raise PublishError(
            f"{tagged} is already {there}; a release never moves a version's tag (this build "
            f"is {one.digest})"
        )
    with tempfile.TemporaryDirectory(prefix="gpuusage-layout-") as work:
        with tarfile.open(one.archive) as layout:
            layout.extractall(work, filter="data")
        _run(crane, "push", work, tagged)
    served = _run(crane, "digest", tagged).strip()
    if served != one.digest:
        raise PublishError(f"{tagged} is {served} in the registry, {one.digest} as built")
    return f"{registry}/{short}@{one.digest}"


def sign(cosign: Path, key: Signer, reference: str) -> None:
    """Sign the index and, recursively, each platform's manifest: one deployed by its own
    digest is signed too."""
    _run(
        cosign,
        *("sign", "--yes", "--recursive", "--key", str(key.key)),
        *("--signing-config", str(key.config), reference),
        env={"COSIGN_PASSWORD": key.password},
    )


def attest(cosign: Path, key: Signer, reference: str, predicate: Path, kind: str) -> None:
    """Attach `predicate` (a file) to `reference` as a signed attestation of cosign's `kind`."""
    _run(
        cosign,
        *("attest", "--yes", "--key", str(key.key), "--signing-config", str(key.config)),
        *("--type", kind, "--predicate", str(predicate), reference),
        env={"COSIGN_PASSWORD": key.password},
    )


def verify(cosign: Path, public: Path, reference: str, kind: str | None = None) -> str:
    """cosign's verification of the signature (or, with `kind`, the attestation) as a user
    runs it; raises PublishError where it fails."""
    command = ("verify",) if kind is None else ("verify-attestation", "--type", kind)
    return _run(cosign, *command, "--key", str(public), "--insecure-ignore-tlog=true", reference)


def publish(
    built: list[Built], registry: str, version: str, dist: Path, tools: Mapping[str, Path]
) -> dict[str, str]:
    """Push, sign and attest every image; image name → its reference by digest."""
    key, generated = signer(tools["cosign"], dist, os.environ)
    if generated:
        print(f"make release: no COSIGN_KEY; signed with a new key pair: {key.key}, {key.public}")
    published: dict[str, str] = {}
    for one in built:
        reference = push(tools["crane"], one, registry, version)
        sign(tools["cosign"], key, reference)
        repository = reference.split("@", 1)[0]
        for platform, sbom in one.sboms.items():
            manifest = f"{repository}@{one.platforms[platform]}"
            attest(tools["cosign"], key, manifest, sbom, "spdxjson")
        with tempfile.TemporaryDirectory(prefix="gpuusage-provenance-") as work:
            made = json.loads(one.provenance.read_text())
            predicate = Path(work) / "predicate.json"
            predicate.write_text(json.dumps(made["predicate"]))
            attest(tools["cosign"], key, reference, predicate, "slsaprovenance1")
        published[one.name] = reference
    return published
