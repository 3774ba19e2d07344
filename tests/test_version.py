"""One version everywhere: gpuusage.__version__ is the SemVer X.Y.Z the next release publishes,
and the package, `gpuusage --version`, the images' tags and labels, the chart, the Krew manifest
and the CHANGELOG say the same. Each check is shown to fail on a copy of the repository with
one place changed."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuusage
from gpuusage.cli import build_parser
from gpuusage_dev import chart
from gpuusage_dev.localcluster.images import Image, oci_archive
from gpuusage_dev.localcluster.productimages import git_revision, image_labels, recipe_of
from gpuusage_dev.version import (
    CHANGELOG,
    DOCKERFILES,
    INIT,
    changelog_problems,
    problems,
    release_notes,
    release_problems,
    version_of,
)

REPO = Path(__file__).resolve().parents[1]
VERSION = gpuusage.__version__
COPIED = ("src/gpuusage/__init__.py", "pyproject.toml", "CHANGELOG.md", "README.md", "LICENSE")
COPIED_TREES = ("manifests", "charts", "docs", "plugins", "nodeagent", "operator", "crds")


def test_every_place_names_the_one_version() -> None:
    assert version_of(REPO) == VERSION, "the installed package is another checkout's"
    assert problems(REPO) == []


def test_the_package_and_the_command_say_it() -> None:
    """The installed metadata (pip, the wheel) and `gpuusage --version`, as a person runs it."""
    assert importlib.metadata.version("gpuusage") == VERSION, "run `make .venv/.installed`"
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert shown.getvalue() == f"gpuusage {VERSION}\n"
    ran = subprocess.run(
        [sys.executable, "-m", "gpuusage", "--version"], capture_output=True, text=True, check=True
    )
    assert ran.stdout == f"gpuusage {VERSION}\n"


def _copy(tmp_path: Path) -> Path:
    """What the version checks read, copied: a repository to break."""
    for name in COPIED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, tmp_path / name)
    for tree in COPIED_TREES:
        shutil.copytree(REPO / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


BREAKS = [
    ("src/gpuusage/__init__.py", '__version__ = "0.1.0"', '__version__ = "0.1.0.dev0"', "SemVer"),
    (
        "pyproject.toml",
        'version = { attr = "gpuusage.__version__" }',
        'version = "0.1.0"',
        "dynamic",
    ),
    ("charts/gpuusage/Chart.yaml", "version: 0.1.0", "version: 0.0.9", "version is '0.0.9'"),
    ("charts/gpuusage/Chart.yaml", 'appVersion: "0.1.0"', 'appVersion: "0.2"', "appVersion"),
    ("charts/gpuusage/values.yaml", 'tag: ""  # empty', 'tag: "0.0.9"  # empty', "agent.image.tag"),
    ("manifests/base/kustomization.yaml", "newTag: 0.1.0", "newTag: 0.0.9", "newTag"),
    ("manifests/base/agent/daemonset.yaml", "agent:0.1.0", "agent:0.0.9", "agent:0.0.9"),
    ("docs/local-cluster.md", "operator:0.1.0", "operator:v0.0.9", "operator:v0.0.9"),
    ("docs/local-cluster.md", "agent:0.1.0`", "agent:0.1.1`", "agent:0.1.1"),
    ("nodeagent/Dockerfile", "agent:0.1.0", "agent:0.0.9", "agent:0.0.9"),
    ("operator/Dockerfile", "ARG VERSION=0.1.0", "ARG VERSION=0.0.9", "ARG VERSION=0.0.9"),
    ("operator/Dockerfile", "ARG REVISION=unknown", "ARG REVISION=main", "REVISION"),
    ("nodeagent/Dockerfile", '.version="${VERSION}"', '.version="0.1.0"', "image.version"),
    ("nodeagent/Dockerfile", 'revision="${REVISION}"', 'revision=""', "image.revision"),
    ("operator/Dockerfile", 'licenses="Apache-2.0"', 'licenses="MIT"', "image.licenses"),
    ("operator/Dockerfile", 'gpuusage/gpuusage"', 'elsewhere/gpuusage"', "image.source"),
    ("operator/Dockerfile", "image.description=", "image.about=", "image.description"),
    ("plugins/krew/gpuusage.yaml", "version: v0.1.0", "version: v0.0.9", "spec.version"),
    ("plugins/krew/gpuusage.yaml", "download/v0.1.0/", "download/v0.0.9/", "not of release"),
    ("CHANGELOG.md", "## [Unreleased]", "## Unreleased", "first section"),
]


@pytest.mark.parametrize(("path", "old", "new", "said"), BREAKS, ids=[b[0] for b in BREAKS])
def test_each_check_fails_when_its_place_disagrees(
    tmp_path: Path, path: str, old: str, new: str, said: str
) -> None:
    root = _copy(tmp_path)
    assert problems(root) == []
    text = (root / path).read_text()
    assert old in text, f"{path} no longer holds {old!r}: update the test"
    (root / path).write_text(text.replace(old, new, 1))
    found = problems(root)
    assert found, f"{path}: {new!r} went unnoticed"
    assert any(said in p and path in p for p in found), found


def test_a_bump_missing_one_place_names_both_versions(tmp_path: Path) -> None:
    """__version__ bumped; `make chart` run, the Krew manifest and the tags not yet."""
    root = _copy(tmp_path)
    init = root / INIT
    init.write_text(init.read_text().replace(f'"{VERSION}"', '"9.8.7"'))
    chart.sync(root)
    found = problems(root)
    assert not [p for p in found if "Chart.yaml" in p], "make chart writes the chart's version"
    assert any(p.startswith("manifests/base/kustomization.yaml") and "'9.8.7'" in p for p in found)
    assert any(p.startswith("plugins/krew/gpuusage.yaml") and "'9.8.7'" in p for p in found)


def _changelog(*released: str, unreleased: str = "## [Unreleased]\n\n- next\n") -> str:
    return "# Changelog\n\n" + unreleased + "".join(f"\n{r}\n" for r in released)


def _release(version: str, day: str, upgrading: str = "### Upgrading\n- Nothing.\n") -> str:
    return f"## [{version}] - {day}\n\n### Added\n- it\n\n{upgrading}"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (_changelog(), "0.1.0"),  # before the first release: [Unreleased] prepares it
        (_changelog(_release("0.1.0", "2026-12-01")), "0.1.0"),  # the release commit
        (_changelog(_release("0.1.0", "2026-12-01")), "0.2.0"),  # main after the bump
        (
            _changelog(_release("0.2.0", "2027-01-05"), _release("0.1.0", "2026-12-01")),
            "0.2.0",
        ),
    ],
    ids=["before-the-first", "the-release-commit", "after-the-bump", "two-releases"],
)
def test_the_changelog_rule_holds_before_at_and_after_a_release(text: str, version: str) -> None:
    assert changelog_problems(text, version) == []


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (_changelog(unreleased="## Unreleased\n"), "first section"),
        (_changelog(_release("0.2.0", "2026-12-01")), "newer than gpuusage.__version__"),
        (_changelog(_release("0.1.0", "2026-12-01", upgrading="")), "no `### Upgrading`"),
        (_changelog("## [0.1.0]\n\n### Upgrading\n- Nothing.\n"), "is not `## [X.Y.Z] - YYYY"),
        (_changelog(_release("0.1.0", "2026-13-01")), "no valid date"),
        (_changelog(_release("0.1", "2026-12-01")), "is not `## [X.Y.Z] - YYYY"),
        (
            _changelog(_release("0.0.9", "2026-12-01"), _release("0.1.0", "2026-11-01")),
            "above [0.1.0] but not newer",
        ),
        (
            _changelog(_release("0.1.0", "2026-12-01"), unreleased="") + "## [Unreleased]\n",
            "first section",
        ),
    ],
    ids=[
        "unbracketed",
        "newer-than-the-package",
        "no-upgrading",
        "no-date",
        "bad-date",
        "not-semver",
        "out-of-order",
        "unreleased-below",
    ],
)
def test_the_changelog_rule_can_fail(text: str, said: str) -> None:
    found = changelog_problems(text, "0.1.0")
    assert any(said in p for p in found), found


def test_the_repositorys_changelog_prepares_the_version() -> None:
    text = (REPO / CHANGELOG).read_text()
    assert text.split("\n## ", 2)[1].startswith("[Unreleased]\n")
    assert changelog_problems(text, VERSION) == []


def test_a_release_of_another_version_is_refused_naming_both(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    refused = release_problems(root, "0.2.0")
    assert f"VERSION=0.2.0 is not gpuusage.__version__ {VERSION}" in refused[0]
    assert any(f"no `## [{VERSION}] - YYYY-MM-DD` section" in p for p in refused)
    log = root / CHANGELOG
    notes = log.read_text().split("## [Unreleased]\n", 1)[1].strip()
    log.write_text(  # the release commit: the notes moved under the release's dated heading
        f"# Changelog\n\n## [Unreleased]\n\n## [{VERSION}] - 2026-12-01\n\n{notes}\n\n"
        "### Upgrading\n- Nothing.\n"
    )
    assert release_problems(root, VERSION) == []
    assert release_notes(log.read_text(), VERSION) == f"{notes}\n\n### Upgrading\n- Nothing.\n"


@pytest.mark.parametrize("dockerfile", [str(d) for d in DOCKERFILES])
def test_the_images_are_labelled_with_the_version_and_the_commit(dockerfile: str) -> None:
    """What the product's image builder puts in the image config, from the same source as
    everything else; no time of building, so a commit gives the same bytes."""
    labels = image_labels(REPO, recipe_of((REPO / dockerfile).read_text()))
    head = subprocess.run(
        ["git", "-c", f"safe.directory={REPO}", "-C", str(REPO), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    oci = "org.opencontainers.image."
    assert labels[oci + "version"] == VERSION
    assert labels[oci + "revision"] == head
    assert labels[oci + "source"] == "https://github.com/gpuusage/gpuusage"
    assert labels[oci + "licenses"] == "Apache-2.0"
    assert labels[oci + "description"].startswith("gpuusage ")
    assert not [k for k in labels if k.endswith(".created")]
    image = Image("x/y:1", {}, labels=labels)
    assert oci_archive(image) == oci_archive(Image("x/y:1", {}, labels=dict(labels)))
    config = _config(oci_archive(image))
    assert config["config"]["Labels"] == labels


def test_outside_git_the_revision_is_unknown(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    assert git_revision(root) == "unknown"
    labels = image_labels(root, recipe_of((root / "operator/Dockerfile").read_text()))
    assert labels["org.opencontainers.image.revision"] == "unknown"
    assert labels["org.opencontainers.image.version"] == VERSION


def _config(archive: bytes) -> dict[str, dict[str, dict[str, str]]]:
    import tarfile  # noqa: PLC0415

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:

        def blob(digest: str) -> bytes:
            found = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert found is not None
            return found.read()

        index = tar.extractfile("index.json")
        assert index is not None
        manifest = json.loads(blob(json.load(index)["manifests"][0]["digest"]))
        config: dict[str, dict[str, dict[str, str]]] = json.loads(
            blob(manifest["config"]["digest"])
        )
        return config
