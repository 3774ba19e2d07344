"""The Helm chart's copies of files kept once elsewhere in the repository.

Helm reads nothing outside a chart's folder, so charts/gpuusage holds copies of the CRDs (in
files/crds/: its templates/crds.yaml renders them, so that `helm upgrade` upgrades them; Helm
never upgrades what a chart keeps in crds/), of the monitoring data its templates embed (the
kube-state-metrics config, the rules file, the dashboards), and of the LICENSE, which a
packaged chart carries. Its Chart.yaml's `version`
and `appVersion` are gpuusage.__version__ (the chart is released with the images, under the
same version). `make chart` (also run by `make crd` and `make monitoring`) writes them; a test
fails when a copy differs from its source.

    python -m gpuusage_dev.chart [ROOT]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from gpuusage_dev.version import version_of

CHART = Path("charts/gpuusage")
CHART_YAML = CHART / "Chart.yaml"
MONITORING = Path("manifests/monitoring")


def copies(root: Path) -> list[tuple[Path, Path]]:
    """(source, copy in the chart) for every file the chart repeats, relative to root."""
    pairs = [
        (path, CHART / "files" / "crds" / path.name)
        for path in sorted((root / "crds").glob("*.yaml"))
        if path.name != "kustomization.yaml"
    ]
    pairs += [
        (root / MONITORING / name, CHART / "files" / name)
        for name in ("gpunodeusage-metrics.yaml", "gpuusage.rules.yaml")
    ]
    pairs += [
        (path, CHART / "files" / "dashboards" / path.name)
        for path in sorted((root / MONITORING / "dashboards").glob("*.json"))
    ]
    pairs.append((root / "LICENSE", CHART / "LICENSE"))
    return [(source.relative_to(root), copy) for source, copy in pairs]


def versioned(chart_yaml: str, version: str) -> str:
    """Chart.yaml with its `version` and `appVersion` set to `version`, all else as written."""
    # appVersion quoted, as `helm create` writes it: a version such as 1.10 stays a string
    for field, value in (("version", version), ("appVersion", f'"{version}"')):
        chart_yaml, found = re.subn(
            rf"^{field}:.*$", f"{field}: {value}", chart_yaml, count=1, flags=re.M
        )
        if not found:
            raise ValueError(f"{CHART_YAML} has no top-level {field}")
    return chart_yaml


def stale(root: Path) -> list[Path]:
    """The chart's copies that are missing or differ from their source, copies of sources
    that no longer exist, and Chart.yaml when it names another version than the package."""
    wanted = copies(root)
    out = [copy for source, copy in wanted if _bytes(root / copy) != (root / source).read_bytes()]
    chart_yaml = (root / CHART_YAML).read_text()
    if versioned(chart_yaml, version_of(root)) != chart_yaml:
        out.append(CHART_YAML)
    kept = {copy for _, copy in wanted}
    for folder in (CHART / "files" / "crds", CHART / "files" / "dashboards"):
        held = (p.relative_to(root) for p in (root / folder).glob("*"))
        out += sorted(p for p in held if p not in kept)
    return out


def _bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def sync(root: Path) -> list[Path]:
    """Write the copies that are stale, remove those of sources gone; what changed."""
    changed = stale(root)
    sources = dict((copy, source) for source, copy in copies(root))
    for copy in changed:
        target = root / copy
        if copy == CHART_YAML:
            target.write_text(versioned(target.read_text(), version_of(root)))
        elif copy in sources:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((root / sources[copy]).read_bytes())
        else:
            target.unlink()
    return changed


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path.cwd()
    for path in sync(root):
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
