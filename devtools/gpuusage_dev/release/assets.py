"""The files a GitHub release carries beside the images: the kubectl plugin's Krew archives
(one per platform, gpuusage_dev.krewplugin) and SHA256SUMS over them. The archives are built
byte for byte the same from the same sources, so the release refuses to go on where the Krew
manifest in the tree (plugins/krew/gpuusage.yaml, what `kubectl krew install` reads) names
other archives than this build makes: `make plugin` and commit it first."""

from __future__ import annotations

from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev import krewplugin

SUMS = "SHA256SUMS"


class AssetError(GpuusageError):
    """The Krew manifest in the tree does not name the archives built."""


def sums(digests: dict[str, str]) -> str:
    """SHA256SUMS as `sha256sum --check` reads it: `<hex>  <name>`, sorted by name."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))


def plugin_assets(out: Path, repo: Path) -> list[Path]:
    """The Krew archives and SHA256SUMS, written into `out`; refused where the manifest in
    the tree names other archives."""
    digests = krewplugin.build(out, repo)
    wanted = krewplugin.manifest(digests)
    if (repo / krewplugin.MANIFEST).read_text() != wanted:
        raise AssetError(
            f"{krewplugin.MANIFEST} names other archives than this build makes: run "
            "`make plugin` and commit it before the release"
        )
    named = {platform.archive: digest for platform, digest in digests.items()}
    (out / SUMS).write_text(sums(named))
    return [*(out / name for name in sorted(named)), out / SUMS]
