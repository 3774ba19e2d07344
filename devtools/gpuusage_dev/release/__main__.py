"""`make release` (gpuusage_dev.release.make): refuses a checkout that is not one clean
commit, then builds into --out and, with --registry, publishes there."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster.images import Platform
from gpuusage_dev.localcluster.platforms import RELEASE_PLATFORMS
from gpuusage_dev.localcluster.productimages import REPO
from gpuusage_dev.release.make import release, unreleasable


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
    try:
        why = unreleasable(REPO)
        if why is not None:
            raise GpuusageError(why)
        release(
            REPO,
            args.out,
            args.registry.rstrip("/"),
            platforms=tuple(args.platform or RELEASE_PLATFORMS),
            keyless=args.keyless,
            command=args.command,
        )
    except GpuusageError as error:
        print(f"release: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
