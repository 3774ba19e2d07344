"""`make release`: the images built and checked into dist/images, the kubectl plugin's Krew
archives and SHA256SUMS into dist/, then, with --registry, the images pushed, signed and
attested there (docs/development.md, "How a release is cut")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster.productimages import REPO, git_output, git_revision
from gpuusage_dev.localcluster.tools import COSIGN, CRANE, ensure_tool
from gpuusage_dev.release.assets import plugin_assets
from gpuusage_dev.release.images import build
from gpuusage_dev.release.publish import publish
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
    args = parser.parse_args(argv)
    try:
        why = unreleasable(REPO)
        if why is not None:
            raise GpuusageError(why)
        built = build(args.out / "images", command=args.command, must_run=True)
        for one in built:
            print(f"built {one.name}@{one.digest}")
        for asset in plugin_assets(args.out, REPO):
            print(f"built {asset}")
        if args.registry:
            tools = {"crane": ensure_tool(CRANE), "cosign": ensure_tool(COSIGN)}
            version = version_of(REPO)
            published = publish(built, args.registry.rstrip("/"), version, args.out, tools)
            (args.out / "published.json").write_text(json.dumps(published, indent=2) + "\n")
            for reference in published.values():
                print(f"published {reference} (signed; SBOMs and provenance attested)")
    except GpuusageError as error:
        print(f"release: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
