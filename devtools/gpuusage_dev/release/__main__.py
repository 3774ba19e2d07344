"""`make release`: the images built and checked into dist/images, the chart packaged with
those images pinned by digest, the kubectl plugin's Krew archives and manifest, and SHA256SUMS
into dist/; then, with --registry, the images and the chart pushed, signed and attested there,
and every signature verified (docs/development.md, "How a release is cut")."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster.images import Platform
from gpuusage_dev.localcluster.platforms import RELEASE_PLATFORMS
from gpuusage_dev.localcluster.productimages import REPO, git_output, git_revision
from gpuusage_dev.localcluster.tools import COSIGN, CRANE, HELM, ensure_tool
from gpuusage_dev.release import chart
from gpuusage_dev.release.assets import plugin_assets, write_sums
from gpuusage_dev.release.images import build
from gpuusage_dev.release.publish import keyless_signer, publish, signer
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuusage_dev.release", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("dist"))
    parser.add_argument("--registry", default="", help="host[:port]/path to publish to")
    parser.add_argument("--command", default="make release", help="for the provenance")
    parser.add_argument(
        "--keyless",
        action="store_true",
        help="sign keyless, as the workflow's OIDC identity (GitHub Actions only)",
    )
    parser.add_argument(
        "--platform",
        action="append",
        type=Platform.parse,
        help="only this platform (linux/amd64, linux/arm64); repeat it; default: both. A "
        "release names both: fewer is for a test's short form",
    )
    args = parser.parse_args(argv)
    registry = args.registry.rstrip("/")
    try:
        why = unreleasable(REPO)
        if why is not None:
            raise GpuusageError(why)
        helm = ensure_tool(HELM)
        tools = {"helm": helm, "crane": ensure_tool(CRANE), "cosign": ensure_tool(COSIGN)}
        # Chosen before the build: a keyless release outside its workflow stops at once.
        if args.keyless:
            key = keyless_signer(os.environ)
        elif registry:
            key, generated = signer(tools["cosign"], args.out, os.environ)
            if generated:
                print(f"release: no COSIGN_KEY, a new key pair signs: {key.key}, {key.public}")
        platforms = tuple(args.platform or RELEASE_PLATFORMS)
        built = build(args.out / "images", platforms=platforms, command=args.command, must_run=True)
        for one in built:
            print(f"built {one.name}@{one.digest}")
        packaged = chart.package(REPO, args.out, helm, chart.pins(built, registry))
        assets = [*plugin_assets(args.out, REPO), packaged]
        for asset in [*assets, write_sums(args.out, assets)]:
            print(f"built {asset}")
        if registry:
            version = version_of(REPO)
            published = publish(built, packaged, registry, version, key=key, tools=tools)
            (args.out / "published.json").write_text(json.dumps(published, indent=2) + "\n")
            for reference in published.values():
                print(f"published {reference} (signed and verified)")
    except GpuusageError as error:
        print(f"release: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
