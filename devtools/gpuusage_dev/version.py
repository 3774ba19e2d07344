"""The one version, and every place that repeats it.

`gpuusage.__version__` (src/gpuusage/__init__.py) is the version: on main, the SemVer `X.Y.Z`
that the next `make release` publishes. The package reads it (pyproject.toml's dynamic
version), `gpuusage --version` prints it, the images' labels are made from it
(`productimages`), and so are the chart's `version` and `appVersion` (`make chart`) and the
Krew manifest (`make plugin`). The places a person edits (the install manifests' image tags,
the Dockerfiles' default and example, the CHANGELOG) are checked against it here, so a bump
that misses one fails `tests/test_version.py` with the file and both versions named, and
`make release` refuses a VERSION that is not this one before it builds anything.

    python -m gpuusage_dev.version [--release X.Y.Z | --notes X.Y.Z] [ROOT]
"""

from __future__ import annotations

import argparse
import ast
import datetime
import itertools
import re
import shlex
import sys
import tomllib
from pathlib import Path

import yaml

INIT = Path("src/gpuusage/__init__.py")
CHART = Path("charts/gpuusage/Chart.yaml")
VALUES = Path("charts/gpuusage/values.yaml")
KUSTOMIZATION = Path("manifests/base/kustomization.yaml")
KREW = Path("plugins/krew/gpuusage.yaml")
CHANGELOG = Path("CHANGELOG.md")
DOCKERFILES = (Path("nodeagent/Dockerfile"), Path("operator/Dockerfile"))
IMAGES = ("gpuusage-agent", "gpuusage-operator")
IMAGE_REFERENCE = re.compile(r"/(gpuusage-(?:agent|operator)):(v?\d(?:[\w.-]*\w)?)")
"""Our images named with a tag, wherever a file names them."""
SCANNED = ("manifests", "charts", "docs", "README.md", *map(str, DOCKERFILES))
"""Where an image reference of ours must name the version (the CHANGELOG and the tests may
name others)."""
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
"""X.Y.Z as SemVer writes a release: no pre-release or build part, no leading zeros."""
OCI = "org.opencontainers.image."
LABELS = {
    "version": "${VERSION}",
    "revision": "${REVISION}",
    "source": None,
    "licenses": None,
    "description": None,
}
"""The OCI labels each Dockerfile sets: the version and revision from its build arguments, the
others written out (checked against pyproject.toml where it says them)."""
UNRELEASED = "[Unreleased]"
RELEASED = re.compile(r"\[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d{2}-\d{2})")
UPGRADING = "### Upgrading"


def version_of(root: Path) -> str:
    """`__version__` as src/gpuusage/__init__.py under `root` assigns it (read, not imported:
    `root` may be another checkout than the one installed)."""
    tree = ast.parse((root / INIT).read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise ValueError(f"{INIT} assigns no string __version__")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def project(root: Path) -> dict[str, object]:
    """pyproject.toml's [project] table."""
    table: dict[str, object] = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return table


def source_url(root: Path) -> str:
    """Where the sources are published: pyproject.toml's [project.urls] Source."""
    urls = project(root).get("urls")
    return str(urls.get("Source", "")) if isinstance(urls, dict) else ""


def package_problems(root: Path, version: str) -> list[str]:
    """The version is SemVer X.Y.Z, and the package's metadata reads it."""
    out = []
    if SEMVER.fullmatch(version) is None:
        out.append(
            f"{INIT}: __version__ = {version!r} is not a SemVer release X.Y.Z (the version the "
            "next `make release` publishes; no pre-release or build part)"
        )
    data = tomllib.loads((root / "pyproject.toml").read_text())
    dynamic = data["project"].get("dynamic", [])
    attr = data.get("tool", {}).get("setuptools", {}).get("dynamic", {}).get("version", {})
    if (
        "version" in data["project"]
        or "version" not in dynamic
        or attr != {"attr": "gpuusage.__version__"}
    ):
        out.append(
            "pyproject.toml: the package's version must be dynamic, "
            '[tool.setuptools.dynamic] version = { attr = "gpuusage.__version__" }'
        )
    return out


def chart_problems(root: Path, version: str) -> list[str]:
    """The chart's version and appVersion (written by `make chart`); its images' tags left to
    the appVersion."""
    chart = yaml.safe_load((root / CHART).read_text())
    out = [
        f"{CHART}: {field} is {chart.get(field)!r}, gpuusage.__version__ is {version!r} "
        "(run `make chart`)"
        for field in ("version", "appVersion")
        if str(chart.get(field)) != version
    ]
    values = yaml.safe_load((root / VALUES).read_text())
    for part in ("agent", "operator"):
        tag = values[part]["image"]["tag"]
        if tag not in ("", version):
            out.append(
                f"{VALUES}: {part}.image.tag is {tag!r}, gpuusage.__version__ is {version!r} "
                "(leave it empty: the chart's appVersion)"
            )
    return out


def manifest_problems(root: Path, version: str) -> list[str]:
    """Every tag the install manifests, the chart, the docs and the Dockerfiles give our
    images, and the kustomization's `images:`."""
    out = []
    kustomization = yaml.safe_load((root / KUSTOMIZATION).read_text())
    tags = {
        entry["name"].rsplit("/", 1)[-1]: entry.get("newTag") for entry in kustomization["images"]
    }
    for image in IMAGES:
        if str(tags.get(image)) != version:
            out.append(
                f"{KUSTOMIZATION}: images' newTag of {image} is {tags.get(image)!r}, "
                f"gpuusage.__version__ is {version!r}"
            )
    files: list[Path] = []
    for name in SCANNED:
        path = root / name
        files += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for image, tag in IMAGE_REFERENCE.findall(line):
                if tag != version:
                    out.append(
                        f"{path.relative_to(root)}:{number}: {image}:{tag}, "
                        f"gpuusage.__version__ is {version!r}"
                    )
    return out


def _instructions(dockerfile: str, keyword: str) -> list[str]:
    """The arguments of each `keyword` instruction of a Dockerfile, continuation lines joined."""
    lines = dockerfile.replace("\\\n", " ").splitlines()
    return [
        line.strip()[len(keyword) + 1 :] for line in lines if line.strip().startswith(keyword + " ")
    ]


def dockerfile_args(dockerfile: str) -> dict[str, str]:
    """Each build argument's default, `ARG NAME=default`."""
    pairs = (arg.strip().partition("=") for arg in _instructions(dockerfile, "ARG"))
    return {name: default for name, sep, default in pairs if sep}


def dockerfile_labels(dockerfile: str) -> dict[str, str]:
    """Each LABEL key and value as written (`${NAME}` names a build argument)."""
    pairs = (
        pair.partition("=")
        for line in _instructions(dockerfile, "LABEL")
        for pair in shlex.split(line)
    )
    return {key: value for key, _, value in pairs}


def dockerfile_problems(root: Path, version: str) -> list[str]:
    """Each Dockerfile's default VERSION (what `docker build` labels without --build-arg), its
    REVISION default, and its OCI labels."""
    out = []
    meta = project(root)
    expected = {"source": source_url(root), "licenses": str(meta.get("license", ""))}
    for dockerfile in DOCKERFILES:
        text = (root / dockerfile).read_text()
        args = dockerfile_args(text)
        if args.get("VERSION") != version:
            out.append(
                f"{dockerfile}: ARG VERSION={args.get('VERSION')}, gpuusage.__version__ is "
                f"{version!r}"
            )
        if args.get("REVISION") != "unknown":
            out.append(f"{dockerfile}: ARG REVISION=unknown is the default outside git")
        for name, fixed in LABELS.items():
            value = dockerfile_labels(text).get(OCI + name)
            wanted = fixed or expected.get(name)
            if not value or (wanted and value != wanted):
                out.append(
                    f"{dockerfile}: LABEL {OCI}{name}={value!r}, wanted {wanted or 'a value'!r}"
                )
    return out


def krew_problems(root: Path, version: str) -> list[str]:
    """The Krew manifest's version and its archives' release (written by `make plugin`)."""
    spec = yaml.safe_load((root / KREW).read_text())["spec"]
    tag = f"v{version}"
    out = []
    if spec["version"] != tag:
        out.append(
            f"{KREW}: spec.version is {spec['version']!r}, gpuusage.__version__ is "
            f"{version!r} (run `make plugin`)"
        )
    for platform in spec["platforms"]:
        if f"/releases/download/{tag}/" not in platform["uri"]:
            out.append(f"{KREW}: {platform['uri']} is not of release {tag} (run `make plugin`)")
    if spec.get("homepage") != source_url(root):
        out.append(f"{KREW}: homepage {spec.get('homepage')!r} is not {source_url(root)!r}")
    return out


def changelog_sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each `## ` section, in order."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def changelog_problems(text: str, version: str) -> list[str]:
    """Keep a Changelog's shape, and a rule true before and after each release.

    `## [Unreleased]` comes first. Each released section below it is `## [X.Y.Z] - YYYY-MM-DD`
    with a `### Upgrading` part, newest first. The newest released is `__version__` itself
    (the release commit: `make release` publishes what it says) or older (main after a bump,
    or before the first release: [Unreleased] prepares `__version__`); never newer.
    """
    sections = changelog_sections(text)
    out = []
    if not sections or sections[0][0] != UNRELEASED:
        out.append(f"{CHANGELOG}: the first section is not `## {UNRELEASED}`")
    released: list[tuple[str, datetime.date]] = []
    for heading, body in sections[1:]:
        found = RELEASED.fullmatch(heading)
        if found is None or SEMVER.fullmatch(found["version"]) is None:
            out.append(f"{CHANGELOG}: `## {heading}` is not `## [X.Y.Z] - YYYY-MM-DD`")
            continue
        try:
            day = datetime.date.fromisoformat(found["date"])
        except ValueError:
            out.append(f"{CHANGELOG}: `## {heading}` has no valid date")
            continue
        if not re.search(rf"^{re.escape(UPGRADING)}\s*$", body, re.M):
            out.append(
                f"{CHANGELOG}: [{found['version']}] has no `{UPGRADING}` part (what a user who "
                "upgrades must do; `Nothing.` where nothing)"
            )
        released.append((found["version"], day))
    for (newer, newer_day), (older, older_day) in itertools.pairwise(released):
        if _key(newer) <= _key(older) or newer_day < older_day:
            out.append(f"{CHANGELOG}: [{newer}] is above [{older}] but not newer")
    if released and SEMVER.fullmatch(version) and _key(released[0][0]) > _key(version):
        out.append(
            f"{CHANGELOG}: its newest release [{released[0][0]}] is newer than "
            f"gpuusage.__version__ {version!r}"
        )
    return out


def release_notes(text: str, version: str) -> str:
    """The CHANGELOG's section of `version` without its heading: the GitHub release's notes."""
    for heading, body in changelog_sections(text):
        found = RELEASED.fullmatch(heading)
        if found is not None and found["version"] == version:
            return body.strip() + "\n"
    raise ValueError(f"{CHANGELOG} has no section [{version}]")


def problems(root: Path) -> list[str]:
    """Every place that disagrees with `__version__`, each naming the file and both versions."""
    version = version_of(root)
    return [
        *package_problems(root, version),
        *chart_problems(root, version),
        *manifest_problems(root, version),
        *dockerfile_problems(root, version),
        *krew_problems(root, version),
        *changelog_problems((root / CHANGELOG).read_text(), version),
    ]


def release_problems(root: Path, asked: str) -> list[str]:
    """Why `make release VERSION=asked` must not publish: another version than `__version__`
    (both named), a place that disagrees, or a CHANGELOG without the release's dated section."""
    version = version_of(root)
    out = []
    if asked != version:
        out.append(
            f"VERSION={asked} is not gpuusage.__version__ {version} ({INIT}): a release "
            "publishes the version main says; set VERSION to it, or bump __version__ first"
        )
    out += problems(root)
    sections = changelog_sections((root / CHANGELOG).read_text())
    top = RELEASED.fullmatch(sections[1][0]) if len(sections) > 1 else None
    if top is None or top["version"] != version:
        out.append(
            f"{CHANGELOG}: no `## [{version}] - YYYY-MM-DD` section under [Unreleased] for the "
            "release (move the Unreleased notes there, with their Upgrading part)"
        )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path.cwd())
    parser.add_argument("--release", metavar="X.Y.Z", help="refuse unless X.Y.Z can be released")
    parser.add_argument("--notes", metavar="X.Y.Z", help="print the CHANGELOG's section of X.Y.Z")
    args = parser.parse_args(argv)
    if args.notes is not None:
        sys.stdout.write(release_notes((args.root / CHANGELOG).read_text(), args.notes))
        return 0
    found = (
        problems(args.root) if args.release is None else release_problems(args.root, args.release)
    )
    for problem in found:
        print(problem, file=sys.stderr)
    if not found:
        print(version_of(args.root))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
