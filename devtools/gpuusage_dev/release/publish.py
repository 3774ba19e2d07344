"""A built release published to a registry: each image index pushed by crane as
`REGISTRY/<image>:<version>` and read back to the digest it was built with; signed with cosign;
each platform's SBOM attached to that platform's manifest and the provenance to the index, as
signed attestations (cosign's own types, `spdxjson` and `slsaprovenance1`); the chart pushed as
`oci://REGISTRY/charts/gpuusage` and signed; then every signature and attestation verified.

Signing is with a key pair, `COSIGN_KEY` (`COSIGN_PASSWORD` its password), or, without it, one
generated into `dist/`, which the build says; a key pair signs without a transparency log (an
empty signing config): verify with `cosign verify --key cosign.pub --insecure-ignore-tlog=true`.
Or keyless (`make release KEYLESS=1`, the hosted release workflow): the workflow's identity,
certified by Sigstore's public Fulcio and logged in Rekor.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.release import chart
from gpuusage_dev.release.images import Built, short_name


class PublishError(GpuusageError):
    """A push, signature or attestation failed, or the registry holds another digest."""


GITHUB_ISSUER = "https://token.actions.githubusercontent.com"


@dataclass(frozen=True)
class Signer:
    """How the release signs and how it is verified: a cosign key pair, signed without a
    transparency log (an empty signing config), or keyless (`key` None): a certificate for the
    workflow's OIDC identity from Sigstore's public Fulcio, logged in Rekor."""

    key: Path | None
    public: Path | None
    password: str = ""
    config: Path | None = None
    """The key pair's empty signing config: no transparency log, no timestamp authority."""
    identity: str = ""
    """Keyless: the certificate's subject, the workflow that signs (its file and ref)."""
    issuer: str = ""

    def signing(self) -> list[str]:
        """cosign sign's and attest's flags."""
        if self.key is None:
            return []
        return ["--key", str(self.key), "--signing-config", str(self.config)]

    def checking(self) -> list[str]:
        """cosign verify's flags: the key, or the identity and its issuer."""
        if self.public is None:
            return [
                *("--certificate-identity", self.identity),
                *("--certificate-oidc-issuer", self.issuer),
            ]
        return ["--key", str(self.public), "--insecure-ignore-tlog=true"]

    @property
    def env(self) -> dict[str, str]:
        return {"COSIGN_PASSWORD": self.password} if self.key is not None else {}


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


def keyless_signer(env: Mapping[str, str]) -> Signer:
    """Keyless signing, in a GitHub Actions workflow with `id-token: write`: cosign takes the
    workflow's OIDC token, and the certificate names the workflow file at the tag it ran for
    (GITHUB_WORKFLOW_REF), which is what users verify against (docs/install.md)."""
    if env.get("COSIGN_KEY"):
        raise PublishError("COSIGN_KEY and keyless signing both asked for: choose one")
    workflow = env.get("GITHUB_WORKFLOW_REF", "")
    if not workflow or not env.get("ACTIONS_ID_TOKEN_REQUEST_URL"):
        raise PublishError(
            "keyless signing needs a GitHub Actions OIDC token (a workflow with "
            "`permissions: id-token: write`); elsewhere sign with COSIGN_KEY or a key pair"
        )
    server = env.get("GITHUB_SERVER_URL", "https://github.com")
    return Signer(None, None, identity=f"{server}/{workflow}", issuer=GITHUB_ISSUER)


ABSENT = ("MANIFEST_UNKNOWN", "NAME_UNKNOWN", "404 Not Found")
"""How a registry says it has no such tag or repository (the OCI distribution spec's codes)."""


def held(crane: Path, what: str, tagged: str) -> str | None:
    """What `crane <what> <tagged>` prints, or None where the registry has no such tag yet.
    Any other failure (no credentials, a registry down) stops the release: taken for "not
    there", it would let a push move a version's tag."""
    try:
        return _run(crane, what, tagged)
    except PublishError as error:
        if any(code in str(error) for code in ABSENT):
            return None
        raise


def push(crane: Path, one: Built, registry: str, version: str) -> str:
    """Push the image's index as `registry/<image>:<version>`: the reference by digest, once
    the registry answers with the digest it was built with."""
    short = short_name(one.name)
    tagged = f"{registry}/{short}:{version}"
    there = (held(crane, "digest", tagged) or "").strip()
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
    """Sign the reference and, for an index, each platform's manifest (--recursive): one
    deployed by its own digest is signed too."""
    _run(cosign, "sign", "--yes", "--recursive", *key.signing(), reference, env=key.env)


def attest(cosign: Path, key: Signer, reference: str, predicate: Path, kind: str) -> None:
    """Attach `predicate` (a file) to `reference` as a signed attestation of cosign's `kind`."""
    _run(
        cosign,
        *("attest", "--yes", *key.signing()),
        *("--type", kind, "--predicate", str(predicate), reference),
        env=key.env,
    )


def verify(cosign: Path, key: Signer, reference: str, kind: str | None = None) -> str:
    """cosign's verification of the signature (or, with `kind`, the attestation) as a user
    runs it; raises PublishError where it fails."""
    command = ("verify",) if kind is None else ("verify-attestation", "--type", kind)
    return _run(cosign, *command, *key.checking(), reference)


CHART_LAYER = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"


def push_chart(tools: Mapping[str, Path], archive: Path, registry: str, version: str) -> str:
    """Push the packaged chart as `oci://registry/charts/gpuusage:<version>`; its reference by
    digest. A version already there is left as it is where it holds these very bytes (a
    release run again), and refused where it holds another chart."""
    tagged = f"{registry}/charts/gpuusage:{version}"
    manifest = held(tools["crane"], "manifest", tagged)
    there = json.loads(manifest) if manifest is not None else None
    if there is not None:
        layers = [layer["digest"] for layer in there["layers"] if layer["mediaType"] == CHART_LAYER]
        ours = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
        if layers != [ours]:
            raise PublishError(
                f"{tagged} already holds another chart ({layers}); a release never moves a "
                f"version's tag (this build's chart is {ours})"
            )
        digest = _run(tools["crane"], "digest", tagged).strip()
    else:
        digest = chart.push(tools["helm"], archive, registry)
    return f"{registry}/charts/gpuusage@{digest}"


def publish(
    built: list[Built],
    packaged: Path,
    registry: str,
    version: str,
    *,
    key: Signer,
    tools: Mapping[str, Path],
) -> dict[str, str]:
    """Push, sign and attest every image, push and sign the chart, then verify every
    signature and attestation as a user would; image name (and "chart") → its reference by
    digest."""
    cosign = tools["cosign"]
    published: dict[str, str] = {}
    attested: list[tuple[str, str]] = []
    for one in built:
        reference = push(tools["crane"], one, registry, version)
        sign(cosign, key, reference)
        repository = reference.split("@", 1)[0]
        for platform, sbom in one.sboms.items():
            manifest = f"{repository}@{one.platforms[platform]}"
            attest(cosign, key, manifest, sbom, "spdxjson")
            attested.append((manifest, "spdxjson"))
        with tempfile.TemporaryDirectory(prefix="gpuusage-provenance-") as work:
            made = json.loads(one.provenance.read_text())
            predicate = Path(work) / "predicate.json"
            predicate.write_text(json.dumps(made["predicate"]))
            attest(cosign, key, reference, predicate, "slsaprovenance1")
            attested.append((reference, "slsaprovenance1"))
        published[one.name] = reference
    published["chart"] = push_chart(tools, packaged, registry, version)
    sign(cosign, key, published["chart"])
    for reference in published.values():
        verify(cosign, key, reference)
    for reference, kind in attested:
        verify(cosign, key, reference, kind)
    return published
