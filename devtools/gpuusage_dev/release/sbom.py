"""What each release image holds, as an SPDX 2.3 JSON SBOM per image and platform, made by
syft (a maintained generator, built from its Go module at a pinned version), then held against
the image's own package databases: every Debian package dpkg lists as installed and every
Python distribution in the image (its `.dist-info`) must be in the SBOM with its version and
purl. A license is what the package states in a form a machine reads (the distributions'
metadata; Debian's machine-readable copyright files): where a Debian package's copyright file
is free text, the SBOM says NOASSERTION rather than a guess, and `unlicensed` names those
packages; their copyright files stay in the image (/usr/share/doc/PACKAGE/copyright)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from gpuusage_dev.localcluster.images import Platform
from gpuusage_dev.localcluster.productimages import ImageBuildError

DPKG_STATUS = "var/lib/dpkg/status"
DIST_INFO = re.compile(r"(^|/)(?:site|dist)-packages/[^/]+\.dist-info/METADATA$")
UNKNOWN = {None, "", "NOASSERTION", "NONE"}


def normalised(name: str) -> str:
    """A Python distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Installed:
    """What an image's own package databases say it holds: name → version."""

    debian: dict[str, str]
    python: dict[str, str]


def _paragraphs(text: str) -> list[dict[str, str]]:
    found: list[dict[str, str]] = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith((" ", "\t")):
                fields[key] = value.strip()
        if fields:
            found.append(fields)
    return found


def installed(layers: list[bytes]) -> Installed:
    """The Debian packages dpkg lists as installed and the Python distributions with a
    METADATA file, across the image's layers (a later layer's file wins)."""
    status = ""
    metadata: dict[str, str] = {}
    for layer in layers:
        with tarfile.open(fileobj=io.BytesIO(layer)) as files:
            for member in files.getmembers():
                wanted = member.name == DPKG_STATUS or DIST_INFO.search(member.name)
                data = files.extractfile(member) if wanted and member.isfile() else None
                if data is None:
                    continue
                text = data.read().decode("utf-8", "replace")
                if member.name == DPKG_STATUS:
                    status = text
                else:
                    metadata[member.name] = text.split("\n\n", 1)[0]
    debian = {
        p["Package"]: p["Version"]
        for p in _paragraphs(status)
        if p.get("Status", "").endswith(" installed") and "Package" in p and "Version" in p
    }
    python: dict[str, str] = {}
    for header in metadata.values():
        (fields,) = _paragraphs(header)[:1] or [{}]
        if "Name" in fields and "Version" in fields:
            python[normalised(fields["Name"])] = fields["Version"]
    return Installed(debian, python)


def make_sbom(syft: Path, archive: Path, platform: Platform) -> dict[str, Any]:
    """syft's SPDX JSON of the image archive's `platform`."""
    with tempfile.TemporaryDirectory(prefix="gpuusage-sbom-") as work:
        out = Path(work) / "sbom.spdx.json"
        try:
            ran = _syft(syft, archive, platform, out, work)
        except subprocess.TimeoutExpired as error:
            raise ImageBuildError(f"syft took over 600 s on {archive}") from error
        if ran.returncode != 0 or not out.is_file():
            raise ImageBuildError(f"syft failed on {archive} ({platform}):\n{ran.stderr[-2000:]}")
        document: dict[str, Any] = json.loads(out.read_text())
    return document


def _syft(
    syft: Path, archive: Path, platform: Platform, out: Path, home: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(syft),
            *("scan", f"oci-archive:{archive}", "--platform", str(platform)),
            *("--output", f"spdx-json={out}", "--quiet"),
        ],
        env={"SYFT_CHECK_FOR_APP_UPDATE": "false", "PATH": "/usr/bin:/bin", "HOME": home},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def _listed(document: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """The SBOM's packages of one purl type (deb, pypi) by name (pypi names normalised)."""
    found: dict[str, dict[str, Any]] = {}
    for package in document.get("packages", []):
        purls = [
            r["referenceLocator"]
            for r in package.get("externalRefs", [])
            if r.get("referenceType") == "purl"
        ]
        if purls and purls[0].startswith(f"pkg:{kind}/"):
            name = normalised(package["name"]) if kind == "pypi" else package["name"]
            found[name] = {**package, "purl": purls[0]}
    return found


def purl_version(purl: str) -> str:
    """The version a purl names, unquoted (`pkg:deb/debian/zlib1g@1%3A1.2.13?arch=…` →
    1:1.2.13); a Debian epoch given as `?epoch=N` is put back in front."""
    head, _, query = purl.partition("?")
    version = unquote(head.partition("@")[2])
    epoch = dict(q.partition("=")[::2] for q in query.split("&") if q).get("epoch")
    return f"{epoch}:{version}" if epoch else version


def sbom_problems(document: dict[str, Any], held: Installed) -> tuple[list[str], list[str]]:
    """What the SBOM leaves out or gets wrong of what the image holds; and the packages whose
    license it cannot name (see the module docstring)."""
    problems: list[str] = []
    unlicensed: list[str] = []
    for kind, expected in (("deb", held.debian), ("pypi", held.python)):
        listed = _listed(document, kind)
        for name, version in sorted(expected.items()):
            package = listed.get(name)
            if package is None:
                problems.append(f"{kind} {name} {version}: not in the SBOM")
                continue
            if package.get("versionInfo") != version:
                problems.append(
                    f"{kind} {name}: {package.get('versionInfo')} in the SBOM, {version} installed"
                )
            if purl_version(package["purl"]) != version:
                problems.append(f"{kind} {name}: purl {package['purl']} names another version")
            if _license(document, package) is None:
                unlicensed.append(f"{kind} {name}")
    return problems, unlicensed


def _license(document: dict[str, Any], package: dict[str, Any]) -> str | None:
    """The package's license as the SBOM names it: declared, else concluded; a LicenseRef
    whose extracted text is NOASSERTION names nothing."""
    texts = {
        info["licenseId"]: info.get("extractedText")
        for info in document.get("hasExtractedLicensingInfos", [])
    }
    for field in ("licenseDeclared", "licenseConcluded"):
        value = package.get(field)
        if value in UNKNOWN:
            continue
        if value in texts and texts[value] in UNKNOWN:
            continue
        return str(value)
    return None


def sbom_for(
    syft: Path, archive: Path, platform: Platform, layers: list[bytes]
) -> tuple[dict[str, Any], list[str]]:
    """The SBOM of the archive's `platform`, checked against that image's `layers`; and the
    packages whose license it cannot name. Raises ImageBuildError where it misses what is
    there."""
    document = make_sbom(syft, archive, platform)
    problems, unlicensed = sbom_problems(document, installed(layers))
    if problems:
        raise ImageBuildError(
            f"the SBOM of {archive.name} ({platform}): {'; '.join(problems[:10])}"
        )
    return document, unlicensed
