"""The release's images: each product image for every release platform as one OCI image
index, checked for what it is, written as an OCI layout archive with its digests.

    python -m gpuusage_dev.release.images --out dist/images        # make images

Per image, `<out>/<image>.oci.tar` (an OCI image layout: the index, each platform's manifest,
config and layers), `<out>/<image>.provenance.json` (how it was made: an in-toto SLSA v1
statement, gpuusage_dev.release.provenance), `<out>/<image>.<os>-<arch>.spdx.json` (what each
platform's image holds, made by syft and checked against the image, gpuusage_dev.release.sbom)
and its entry in `<out>/digests.json`: the index's digest and each platform's. Every
platform's ELF files must be for its CPU; where this machine can run a platform (natively, or
under qemu through binfmt_misc) and runs as root, the image's own `python -m gpuusage
--version` must print the release's version. The same commit gives the same digests: no
image reads a clock (their times are the commit's); the SBOMs carry syft's own time.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster.binaries import Progress, stderr_progress
from gpuusage_dev.localcluster.images import Platform
from gpuusage_dev.localcluster.platforms import RELEASE_PLATFORMS, cannot_emulate
from gpuusage_dev.localcluster.productimages import (
    REPO,
    ImageBuildError,
    product_images,
    release_image,
)
from gpuusage_dev.localcluster.tools import SYFT, ensure_tool
from gpuusage_dev.release.imagecheck import (
    PlatformImages,
    can_run_images,
    layout_blobs,
    platform_images,
    run_version,
    wrong_cpu,
)
from gpuusage_dev.release.provenance import statement
from gpuusage_dev.release.sbom import sbom_for
from gpuusage_dev.version import version_of


@dataclass(frozen=True)
class Built:
    """One release image written out."""

    name: str
    archive: Path
    digest: str
    """The index's digest: what a release pins."""
    platforms: dict[str, str]
    """Platform (linux/arm64) → its manifest's digest."""
    ran: dict[str, str]
    """Platform → what its `python -m gpuusage --version` printed, where it could run."""
    provenance: Path
    """Its in-toto SLSA provenance statement."""
    sboms: dict[str, Path]
    """Platform → its SBOM (SPDX JSON), checked against the image's package databases."""
    unlicensed: list[str]
    """The packages whose license the SBOM cannot name (gpuusage_dev.release.sbom)."""


def short_name(image: str) -> str:
    """ghcr.io/gpuusage/gpuusage-agent:0.1.0 → gpuusage-agent: the file and repository name."""
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


def check(
    images: PlatformImages, version: str, platforms: tuple[Platform, ...], must_run: bool = False
) -> dict[str, str]:
    """Every platform present in the archive's `images` (imagecheck.platform_images), its
    compiled files for its CPU, and its version where it can run here (`must_run`: on every
    platform, as a release demands): platform → what it printed. Raises ImageBuildError naming
    what is wrong."""
    missing = [str(p) for p in platforms if p not in images]
    if missing:
        raise ImageBuildError(f"the index lacks {', '.join(missing)}")
    ran: dict[str, str] = {}
    for platform, (stack, config) in images.items():
        wrong = wrong_cpu(stack, platform)
        if wrong:
            raise ImageBuildError(f"{platform}: not for its CPU: {'; '.join(wrong[:10])}")
        why = can_run_images() or cannot_emulate(platform)
        if why is not None and must_run:
            raise ImageBuildError(f"{platform}: a release runs each image's --version: {why}")
        if why is None:
            printed = run_version(stack, platform, config["config"].get("Env") or [])
            if printed != f"gpuusage {version}":
                raise ImageBuildError(f"{platform}: --version printed {printed!r}")
            ran[str(platform)] = printed
    return ran


def build(
    out: Path,
    *,
    repo: Path = REPO,
    platforms: tuple[Platform, ...] = RELEASE_PLATFORMS,
    progress: Progress = stderr_progress,
    command: str = "make images",
    must_run: bool = False,
) -> list[Built]:
    """Build, check and write every product image for `platforms`, with its provenance
    (`command`: what was run to build it; `must_run`: see check)."""
    out.mkdir(parents=True, exist_ok=True)
    version = version_of(repo)
    syft = ensure_tool(SYFT, progress)
    built: list[Built] = []
    for name, dockerfile in sorted(product_images(repo).items()):
        archive = release_image(repo, dockerfile, name, platforms, progress)
        images = platform_images(archive)
        ran = check(images, version, platforms, must_run)
        entry, blobs = layout_blobs(archive)
        index = json.loads(blobs[entry["digest"]])
        short = short_name(name)
        path = out / f"{short}.oci.tar"
        path.write_bytes(archive)
        made = statement(
            repo,
            dockerfile,
            name.rsplit(":", 1)[0],
            entry["digest"],
            platforms=platforms,
            command=command,
        )
        provenance = out / f"{short}.provenance.json"
        provenance.write_text(json.dumps(made, indent=2) + "\n")
        sboms: dict[str, Path] = {}
        unlicensed: set[str] = set()
        for platform in platforms:
            document, unnamed = sbom_for(syft, path, platform, images[platform][0])
            sboms[str(platform)] = out / f"{short}.{platform.os}-{platform.architecture}.spdx.json"
            sboms[str(platform)].write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
            unlicensed.update(unnamed)
        built.append(
            Built(
                name,
                path,
                entry["digest"],
                {
                    str(Platform(m["platform"]["architecture"], m["platform"]["os"])): m["digest"]
                    for m in index["manifests"]
                },
                ran,
                provenance,
                sboms,
                sorted(unlicensed),
            )
        )
    (out / "digests.json").write_text(
        json.dumps(
            {b.name: {"index": b.digest, "platforms": b.platforms} for b in built},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("dist/images"))
    parser.add_argument("--command", default="make images", help="what was run, for the provenance")
    parser.add_argument(
        "--platform",
        action="append",
        type=Platform.parse,
        help="a platform to build (linux/amd64, linux/arm64); repeat it; default: both",
    )
    args = parser.parse_args(argv)
    platforms = tuple(args.platform or RELEASE_PLATFORMS)
    try:
        built = build(args.out, platforms=platforms, command=args.command)
    except GpuusageError as error:
        print(f"images: {error}", file=sys.stderr)
        return 1
    for one in built:
        print(f"{one.name}@{one.digest}  {one.archive}")
        for platform, digest in one.platforms.items():
            said = one.ran.get(platform, "not run here (no emulation, or not root)")
            print(f"  {platform}  {digest}  {said}  SBOM {one.sboms[platform]}")
        if one.unlicensed:
            print(
                f"  {len(one.unlicensed)} packages state no license a machine reads "
                "(their copyright files are in the image): " + ", ".join(one.unlicensed)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
