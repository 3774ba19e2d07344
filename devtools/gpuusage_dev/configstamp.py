"""The kube-state-metrics Deployment carries the sha256 of its config in its pod template.

The config's ConfigMap has a fixed name (the kustomize install and the Helm chart render the
same objects), so a new gpuusage version with a changed config would leave the running
kube-state-metrics on the old one until something restarted it. The checksum annotation makes
the new version's Deployment differ, so applying it rolls the pod: `make monitoring` writes it
into manifests/monitoring/kube-state-metrics.yaml, the chart computes it with sha256sum, and
tests fail when either is off.

    python -m gpuusage_dev.configstamp manifests/monitoring
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

CONFIG = "gpunodeusage-metrics.yaml"
DEPLOYMENT = "kube-state-metrics.yaml"
ANNOTATION = "gpuusage.io/config-sha256"
_LINE = re.compile(rf"^(\s*{re.escape(ANNOTATION)}: )\"?([0-9a-f]*)\"?$", re.MULTILINE)


def checksum(folder: Path) -> str:
    return hashlib.sha256((folder / CONFIG).read_bytes()).hexdigest()


def stamped(folder: Path) -> str | None:
    """The checksum the Deployment carries; None when it has no such line."""
    found = _LINE.search((folder / DEPLOYMENT).read_text())
    return found.group(2) if found else None


def stamp(folder: Path) -> bool:
    """Write the config's checksum into the Deployment; whether it changed."""
    path = folder / DEPLOYMENT
    text = path.read_text()
    if not _LINE.search(text):
        raise SystemExit(f"{path}: no `{ANNOTATION}:` line to update")
    new = _LINE.sub(lambda m: f'{m.group(1)}"{checksum(folder)}"', text)
    path.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path("manifests/monitoring")
    if stamp(folder):
        print(f"updated {folder / DEPLOYMENT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
