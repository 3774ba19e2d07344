"""The chart as a release publishes it: charts/gpuusage packaged by helm with its values pinned
to the images the release built, by digest, so that `helm install oci://REGISTRY/charts/gpuusage
--version X.Y.Z` runs exactly the images that were signed; pushed by `helm push` as an OCI
artifact beside them.

The package is byte for byte the same for the same commit: helm writes each file's time and
mode into the archive, so the copy it packages has the commit's time and fixed modes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuusage.errors import GpuusageError
from gpuusage_dev.chart import CHART
from gpuusage_dev.localcluster.productimages import commit_time
from gpuusage_dev.release.images import Built, short_name
from gpuusage_dev.version import version_of

COMPONENTS = {"gpuusage-agent": "agent", "gpuusage-operator": "operator"}
"""Each image's repository name → the chart's values key that runs it."""


class ChartError(GpuusageError):
    """The chart could not be pinned, packaged or pushed."""


@dataclass(frozen=True)
class Pin:
    """Where the chart's component pulls its image from: `registry/repository@digest`."""

    registry: str
    repository: str
    digest: str


def pins(built: list[Built], registry: str) -> dict[str, Pin]:
    """Values key → its image's pin. `registry` is `host[:port]/path` (make release's
    REGISTRY); empty: the chart's own registry and repositories, with the built digests."""
    host, _, path = registry.partition("/")
    out: dict[str, Pin] = {}
    for one in built:
        short = short_name(one.name)
        if short not in COMPONENTS:
            raise ChartError(f"the chart runs no image named {short}")
        repository = f"{path}/{short}" if path else short
        pin = Pin(host, repository, one.digest) if host else Pin("", "", one.digest)
        out[COMPONENTS[short]] = pin
    return out


def pinned_values(text: str, wanted: Mapping[str, Pin]) -> str:
    """values.yaml with the top-level `image.registry` and each component's
    `image.repository` and `.digest` set, every other line (its comments too, which `helm show
    values` prints) as written. The registry is the one all components share, so that a
    mirror is one `--set image.registry=...` away. Raises where the chart no longer has those
    keys in that shape, or a component names a registry of its own (it would win over the
    pin)."""
    registries = {pin.registry for pin in wanted.values()}
    if len(registries) > 1:
        raise ChartError(f"one release, one registry: not {sorted(registries)}")
    registry = next(iter(registries), "")
    lines = text.splitlines(keepends=True)
    top = ""
    in_image = False
    for number, line in enumerate(lines):
        if re.match(r"^\S", line):
            top, in_image = line.split(":", 1)[0], False
            continue
        if top == "image" and registry and re.match(r"^  registry:", line):
            lines[number] = f"  registry: {json.dumps(registry)}  # pinned by make release\n"
            continue
        if re.match(r"^  image:\s*$", line):
            in_image = True
            continue
        if re.match(r"^  \S", line):
            in_image = False
        field = re.match(r"^    (repository|digest):", line)
        if in_image and field and top in wanted:
            value = getattr(wanted[top], field.group(1))
            if value:
                lines[number] = (
                    f"    {field.group(1)}: {json.dumps(value)}  # pinned by make release\n"
                )
    pinned = "".join(lines)
    parsed = yaml.safe_load(pinned)
    if registry and (parsed.get("image") or {}).get("registry") != registry:
        raise ChartError("values.yaml has no image.registry to pin")
    for component, pin in wanted.items():
        image = (parsed.get(component) or {}).get("image") or {}
        for key in ("repository", "digest"):
            value = getattr(pin, key)
            if value and image.get(key) != value:
                raise ChartError(f"values.yaml has no {component}.image.{key} to pin")
        if image.get("registry"):
            raise ChartError(f"values.yaml's {component}.image.registry would win over the pin")
    return pinned


def package(repo: Path, out: Path, helm: Path, wanted: Mapping[str, Pin]) -> Path:
    """`helm package` of the chart with pinned values into `out`; the archive's path."""
    when = commit_time(repo)
    with tempfile.TemporaryDirectory(prefix="gpuusage-chart-") as work:
        chart = Path(work) / "gpuusage"
        shutil.copytree(repo / CHART, chart)
        values = chart / "values.yaml"
        values.write_text(pinned_values(values.read_text(), wanted))
        for path in (chart, *chart.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
            os.utime(path, (when, when))
        out.mkdir(parents=True, exist_ok=True)
        _helm(helm, Path(work), "lint", "--strict", str(chart))
        _helm(helm, Path(work), "package", str(chart), "--destination", str(out))
    return out / f"gpuusage-{version_of(repo)}.tgz"


def loopback(registry: str) -> bool:
    """Whether `registry` (host[:port][/path]) is on this machine, spoken to over plain HTTP."""
    address = registry.split("/", 1)[0]
    bracketed = address.startswith("[")  # [v6 address]:port
    host = address[1:].split("]", 1)[0] if bracketed else address.rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost


def push(helm: Path, archive: Path, registry: str) -> str:
    """`helm push` to oci://registry/charts; the chart's digest there. Credentials are the
    ones `docker login` wrote, as for the images (crane and cosign read them too)."""
    docker = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    with tempfile.TemporaryDirectory(prefix="gpuusage-helm-") as work:
        args = ["push", str(archive), f"oci://{registry}/charts"]
        if docker.is_file():
            args += ["--registry-config", str(docker)]
        if loopback(registry):
            args.append("--plain-http")
        said = _helm(helm, Path(work), *args)
    found = re.search(r"^Digest:\s*(sha256:[0-9a-f]{64})", said, re.M)
    if found is None:
        raise ChartError(f"helm push named no digest:\n{said}")
    return found.group(1)


def _helm(helm: Path, home: Path, *args: str) -> str:
    """helm with its config, cache and data in `home`: nothing of the user's is read or
    written but the registry credentials named."""
    env = {
        **os.environ,
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    ran = subprocess.run(
        [str(helm), *args], env=env, capture_output=True, text=True, check=False, timeout=300
    )
    if ran.returncode != 0:
        raise ChartError(f"helm {args[0]} failed:\n{ran.stderr[-2000:]}")
    return ran.stdout + ran.stderr
