"""One statement of the supported Kubernetes releases: what the local cluster runs
(versions.SUPPORTED), the floor the product refuses below (serverversion.FLOOR), the chart's
kubeVersion, and what the README and docs/install.md say."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gpuusage.kube import serverversion
from gpuusage_dev.localcluster import versions

ROOT = Path(__file__).resolve().parent.parent


def _minors() -> list[str]:
    return [f"1.{versions.minor(v)}" for v in versions.SUPPORTED]


def statements(chart: str, install: str, readme: str) -> list[str]:
    """What disagrees with versions.SUPPORTED among the three texts (empty: all agree)."""
    wrong = []
    floor = f"1.{versions.minor(versions.OLDEST)}"
    kube_version = str(yaml.safe_load(chart).get("kubeVersion", ""))
    if kube_version != f">={floor}.0-0":
        wrong.append(f"the chart's kubeVersion is {kube_version!r}, not '>={floor}.0-0'")
    table = re.findall(r"^\| (1\.\d+) \((1\.\d+\.\d+)\) \| yes", install, re.M)
    if [f"v{release}" for _, release in reversed(table)] != list(versions.SUPPORTED):
        wrong.append(f"docs/install.md's table lists {table}, not {versions.SUPPORTED}")
    said = ", ".join(_minors()[:-1]) + f" or {_minors()[-1]}"
    if f"Requirements: Kubernetes {said}" not in " ".join(install.split()):
        wrong.append(f"docs/install.md's requirements do not say {said}")
    if f"Requirements: Kubernetes {said}" not in " ".join(readme.split()):
        wrong.append(f"the README's requirements do not say {said}")
    return wrong


def test_the_chart_the_docs_and_the_local_cluster_agree() -> None:
    texts = [
        (ROOT / "charts/gpuusage/Chart.yaml").read_text(),
        (ROOT / "docs/install.md").read_text(),
        (ROOT / "README.md").read_text(),
    ]
    assert statements(*texts) == []


def test_the_agreement_check_can_fail() -> None:
    chart = (ROOT / "charts/gpuusage/Chart.yaml").read_text()
    install = (ROOT / "docs/install.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert len(statements(chart.replace(">=1.35.0-0", ">=1.32.0-0"), install, readme)) == 1
    assert (
        len(statements(chart, install.replace("| 1.36 (1.36.3) | yes", "| 1.36 | no"), readme)) == 1
    )
    assert len(statements(chart, install, readme.replace("1.35, 1.36 or 1.37", "1.32+"))) == 1


def test_the_products_floor_is_the_oldest_supported_release() -> None:
    assert (1, versions.minor(versions.OLDEST)) == serverversion.FLOOR
    assert serverversion.FLOOR_TEXT in (ROOT / "charts/gpuusage/Chart.yaml").read_text()
