"""What `make release` does, callable: the images built and checked into dist/images, the chart
packaged with those images pinned by digest, the kubectl plugin's Krew archives and manifest,
and SHA256SUMS into dist/; then, with a registry, the images and the chart pushed, signed and
attested there, and every signature verified (docs/development.md, "How a release is cut")."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuusage_dev.localcluster.images import Platform
from gpuusage_dev.localcluster.platforms import RELEASE_PLATFORMS
from gpuusage_dev.localcluster.productimages import git_output, git_revision
from gpuusage_dev.localcluster.tools import COSIGN, CRANE, HELM, ensure_tool
from gpuusage_dev.release import chart
from gpuusage_dev.release.assets import plugin_assets, write_sums
from gpuusage_dev.release.images import Built, build
from gpuusage_dev.release.publish import Signer, keyless_signer, publish, signer
from gpuusage_dev.version import version_of


def unreleasable(repo: Path) -> str | None:
    """Why the checkout cannot be released: the images, their labels and provenance name
    its commit, so it must be one (git), with nothing changed beside it."""
    if git_revision(repo) == "unknown":
        return "a release is built from a git commit: this checkout has none"
    changed = git_output(repo, "status", "--porcelain") or ""
    if changed.strip():
        return f"commit or stash what changed first; the release names the commit:\n{changed}"
    return None


@dataclass(frozen=True)
class Release:
    """What `make release` made: the images, the chart's package, the files beside them, and,
    with a registry, each image's (and "chart"'s) reference by digest there."""

    built: list[Built]
    packaged: Path
    assets: list[Path]
    published: dict[str, str]


def release(
    repo: Path,
    out: Path,
    registry: str = "",
    *,
    platforms: tuple[Platform, ...] = RELEASE_PLATFORMS,
    keyless: bool = False,
    command: str = "make release",
    say: Callable[[str], None] = print,
) -> Release:
    """Build everything into `out` and, with `registry`, publish and verify it there."""
    helm = ensure_tool(HELM)
    tools = {"helm": helm, "crane": ensure_tool(CRANE), "cosign": ensure_tool(COSIGN)}
    key: Signer | None = None
    # Chosen before the build: a keyless release outside its workflow stops at once.
    if keyless:
        key = keyless_signer(os.environ)
    elif registry:
        key, generated = signer(tools["cosign"], out, os.environ)
        if generated:
            say(f"release: no COSIGN_KEY, a new key pair signs: {key.key}, {key.public}")
    built = build(out / "images", repo=repo, platforms=platforms, command=command, must_run=True)
    for one in built:
        say(f"built {one.name}@{one.digest}")
    packaged = chart.package(repo, out, helm, chart.pins(built, registry))
    assets = [*plugin_assets(out, repo), packaged]
    assets.append(write_sums(out, assets))
    for asset in assets:
        say(f"built {asset}")
    published: dict[str, str] = {}
    if registry and key is not None:
        version = version_of(repo)
        published = publish(built, packaged, registry, version, key=key, tools=tools)
        (out / "published.json").write_text(json.dumps(published, indent=2) + "\n")
        for reference in published.values():
            say(f"published {reference} (signed and verified)")
    return Release(built, packaged, assets, published)
