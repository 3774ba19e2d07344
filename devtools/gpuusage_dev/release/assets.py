"""The files a GitHub release carries beside what the registry holds: the kubectl plugin's Krew
archives (one per platform, gpuusage_dev.krewplugin) and its Krew manifest, the packaged chart,
and SHA256SUMS over them (the images' SBOMs and provenance are in the registry, as signed
attestations). The archives are built byte
for byte the same from the same sources, so the release refuses to go on where the Krew
manifest in the tree (plugins/krew/gpuusage.yaml, what `kubectl krew install` reads) names
other archives than this build makes: `make plugin` and commit it first."""

from __future__ import annotations

import hashlib
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev import krewplugin

SUMS = "SHA256SUMS"
KREW_MANIFEST = "gpuusage.krew.yaml"
"""The Krew manifest's name in the release (`kubectl krew install --manifest=...`)."""


class AssetError(GpuusageError):
    """The Krew manifest in the tree does not name the archives built."""


def sums(digests: dict[str, str]) -> str:
    """SHA256SUMS as `sha256sum --check` reads it: `<hex>  <name>`, sorted by name."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))


def plugin_assets(out: Path, repo: Path) -> list[Path]:
    """The Krew archives and the Krew manifest, written into `out`; refused where the
    manifest in the tree names other archives."""
    digests = krewplugin.build(out, repo)
    wanted = krewplugin.manifest(digests)
    if (repo / krewplugin.MANIFEST).read_text() != wanted:
        raise AssetError(
            f"{krewplugin.MANIFEST} names other archives than this build makes: run "
            "`make plugin` and commit it before the release"
        )
    (out / KREW_MANIFEST).write_text(wanted)
    return [*sorted(out / platform.archive for platform in digests), out / KREW_MANIFEST]


def write_sums(out: Path, files: list[Path]) -> Path:
    """SHA256SUMS in `out` over `files` (each in `out` or below it, named from there)."""
    named = {
        str(path.relative_to(out)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files
    }
    (out / SUMS).write_text(sums(named))
    return out / SUMS
