"""`kubectl gpuusage` as Krew installs it: one archive per platform and the plugin manifest.

Each archive holds `kubectl-gpuusage`, a single-file zip application of the people's commands
(the shared package and `gpuusage_commands`, with the libraries they import at the versions
operator/requirements.lock pins) run by the user's `python3` (3.11 or later), and the LICENSE.
pydantic's core is compiled, and Python imports no compiled module from inside a zip: the
application carries that core for each CPython it supports on its platform and unpacks itself
once into the user's cache (`$XDG_CACHE_HOME/gpuusage/kubectl-plugin/<build>`), as shiv-built
applications do. Nothing else is compiled (PyYAML's optional C speedups are left out).

Archives are built byte for byte the same from the same sources and wheels (entries sorted,
times and owners fixed), so the manifest's sha256 is held by a test: `make plugin` rebuilds the
archives into dist/ and rewrites plugins/krew/gpuusage.yaml.

    python -m gpuusage_dev.krewplugin [--out dist] [--manifest plugins/krew/gpuusage.yaml]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuusage import __version__
from gpuusage_dev.localcluster.binaries import cache_root, file_lock

REPO = Path(__file__).resolve().parents[2]
MANIFEST = Path("plugins/krew/gpuusage.yaml")
LOCK = Path("operator/requirements.lock")
SOURCES = (("src/gpuusage", "gpuusage"), ("commands/gpuusage_commands", "gpuusage_commands"))
PYTHONS = ("3.11", "3.12", "3.13", "3.14")
"""The CPythons whose compiled pydantic core each archive carries."""

PURE = (
    "annotated-types",
    "certifi",
    "charset-normalizer",
    "durationpy",
    "idna",
    "kubernetes",
    "oauthlib",
    "pydantic",
    "python-dateutil",
    "requests",
    "requests-oauthlib",
    "typing-extensions",
    "typing-inspection",
    "urllib3",
    "websocket-client",
)
"""What the commands import, beside the compiled core and PyYAML: wheels for any platform."""
NATIVE = "pydantic-core"
ANY = ["--platform", "any", "--python-version", "3.11", "--implementation", "py", "--abi", "none"]
"""pip's arguments for a pure wheel (never the compiled build some packages also publish)."""
PYYAML = "pyyaml"
PYYAML_WHEEL = [
    *("--python-version", "3.11", "--implementation", "cp"),
    *("--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"),
]
"""PyYAML publishes no pure wheel; its Python files are the same in every one, and only
those are taken (its C speedups are optional), so every archive takes them from this one."""


@dataclass(frozen=True)
class Platform:
    os: str
    arch: str
    wheel_platforms: tuple[str, ...]
    """pip's --platform tags whose wheels run there, most specific first."""

    @property
    def archive(self) -> str:
        return f"kubectl-gpuusage-{self.os}-{self.arch}.tar.gz"


PLATFORMS = (
    Platform("linux", "amd64", ("manylinux_2_17_x86_64", "manylinux2014_x86_64")),
    Platform("linux", "arm64", ("manylinux_2_17_aarch64", "manylinux2014_aarch64")),
    Platform("darwin", "amd64", ("macosx_10_12_x86_64",)),
    Platform("darwin", "arm64", ("macosx_11_0_arm64",)),
)

LAUNCHER = '''\
"""kubectl-gpuusage: the people's commands of gpuusage (see gpuusage.cli), unpacked once."""
import os
import shutil
import sys
import tempfile
import zipfile

if sys.version_info < (3, 11):
    sys.exit("kubectl-gpuusage needs Python 3.11 or later; python3 is %d.%d" % sys.version_info[:2])
here = os.path.dirname(os.path.abspath(__file__))
with zipfile.ZipFile(here) as packed:
    build = packed.read("BUILD").decode().strip()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    target = os.path.join(cache, "gpuusage", "kubectl-plugin", build)
    if not os.path.isdir(target):
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            staged = tempfile.mkdtemp(prefix=".unpack-", dir=os.path.dirname(target))
        except OSError as exc:
            sys.exit("kubectl-gpuusage cannot unpack itself into %s: %s (set XDG_CACHE_HOME "
                     "to a writable folder)" % (os.path.dirname(target), exc))
        try:
            packed.extractall(staged, [n for n in packed.namelist() if n.startswith("site/")])
            os.replace(staged, target)
        except OSError:  # another run unpacked it first, or the unpack failed: said below
            shutil.rmtree(staged, ignore_errors=True)
sys.path[:0] = [os.path.join(target, "site")]
try:
    import pydantic_core  # noqa: F401
except ImportError as exc:
    sys.exit("kubectl-gpuusage cannot load pydantic's core (%s); it carries it for CPython 3.11 "
             "to 3.14 on glibc Linux and macOS, and python3 is %s %d.%d: pip install gpuusage "
             "instead" % (exc, sys.implementation.name, *sys.version_info[:2]))
from gpuusage.cli import kubectl_plugin

sys.exit(kubectl_plugin())
'''


def locked(name: str, lock: str) -> str:
    """The version operator/requirements.lock pins `name` at."""
    for line in lock.splitlines():
        first = line.split(" ", 1)[0]
        if first.lower().startswith(f"{name.lower()}=="):
            return first.split("==", 1)[1]
    raise SystemExit(f"krewplugin: {name} is not in {LOCK}")


def _download(name: str, version: str, args: list[str], into: Path) -> Path:
    """One wheel from the package index, into the cache (kept: the same bytes every build)."""
    prefix = f"{name.replace('-', '_')}-{version}-".lower()

    def found() -> list[Path]:
        return sorted(
            p for p in into.glob("*.whl") if p.name.lower().startswith(prefix) and _fits(p, args)
        )

    if not found():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(into), *args, f"{name}=={version}"],
            check=True,
        )  # fmt: skip
    wheels = found()
    if not wheels:
        raise SystemExit(f"krewplugin: no wheel of {name}=={version} for {' '.join(args)}")
    return wheels[0]


def _fits(wheel: Path, args: list[str]) -> bool:
    """Whether a cached wheel is the one pip would have fetched for `args`."""
    tags = wheel.name[:-4].split("-")[-3:]
    if args == ANY:
        return tags[2] == "any"
    platforms = {args[i + 1] for i, a in enumerate(args) if a == "--platform"}
    python = args[args.index("--python-version") + 1].replace(".", "")
    return tags[0] == f"cp{python}" and bool(platforms & set(tags[2].split(".")))


def wheels_for(platform: Platform, lock: str, cache: Path) -> list[Path]:
    """The wheels one platform's archive unpacks: the pure ones, PyYAML's, and pydantic's
    core for each supported CPython."""
    cache.mkdir(parents=True, exist_ok=True)
    found = [_download(name, locked(name, lock), ANY, cache) for name in PURE]
    on = [arg for tag in platform.wheel_platforms for arg in ("--platform", tag)]
    for python in PYTHONS:
        abi = ["--python-version", python, "--implementation", "cp", *on]
        found.append(_download(NATIVE, locked(NATIVE, lock), abi, cache))
    found.append(_download(PYYAML, locked(PYYAML, lock), PYYAML_WHEEL, cache))
    return found


def _site_entries(wheels: Iterable[Path], repo: Path) -> dict[str, bytes]:
    """site/<path> → bytes: every wheel's files (PyYAML's without its compiled speedups) and
    the shipped sources, without byte code."""
    entries: dict[str, bytes] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as packed:
            for name in packed.namelist():
                if name.endswith("/") or "__pycache__" in name:
                    continue
                if wheel.name.lower().startswith("pyyaml") and name.endswith((".so", ".pyd")):
                    continue
                entries[f"site/{name}"] = packed.read(name)
    for source, package in SOURCES:
        for path in _tracked(repo, source):
            relative = path.relative_to(repo / source).as_posix()
            entries[f"site/{package}/{relative}"] = path.read_bytes()
    return entries


def _tracked(repo: Path, source: str) -> list[Path]:
    """The files of `source` that git tracks (in a checkout; else every file but byte code):
    an untracked file (an editor's backup) must not change the archive."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--", source],
        capture_output=True,
        check=False,
    )
    if listed.returncode == 0 and listed.stdout:
        names = [n for n in listed.stdout.decode().split("\0") if n]
        return sorted(repo / n for n in names if (repo / n).is_file())
    return sorted(
        p
        for p in (repo / source).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def zipapp(entries: dict[str, bytes]) -> bytes:
    """The single-file application: a shebang line, then a zip of the launcher, its build ID
    and the site; entries sorted, stored, dated 1980 (the same bytes from the same input)."""
    build = hashlib.sha256()
    for name in sorted(entries):
        build.update(name.encode() + b"\0" + hashlib.sha256(entries[name]).digest())
    files = {**entries, "__main__.py": LAUNCHER.encode(), "BUILD": build.hexdigest()[:16].encode()}
    out = io.BytesIO()
    out.write(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as packed:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            packed.writestr(info, files[name])
    return out.getvalue()


def archive(application: bytes, license_text: bytes) -> bytes:
    """The tar.gz Krew unpacks: kubectl-gpuusage (executable) and the LICENSE."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, mode in (
            ("LICENSE", license_text, 0o644),
            ("kubectl-gpuusage", application, 0o755),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return packed.getvalue()


def semver(version: str) -> str:
    """The release tag Krew takes (semantic versioning) for a Python version: 0.1.0 → v0.1.0,
    0.1.0.dev0 → v0.1.0-dev.0, 0.2.0rc1 → v0.2.0-rc.1."""
    found = re.fullmatch(r"(\d+\.\d+\.\d+)(?:\.?(dev|a|b|rc)\.?(\d+))?", version)
    if found is None:
        raise ValueError(f"{version!r} has no semantic-version form Krew takes")
    base, pre, number = found.groups()
    return f"v{base}" + (f"-{pre}.{number}" if pre else "")


def manifest(sha256: dict[Platform, str], version: str = __version__) -> str:
    """The Krew plugin manifest for these archives, as krew-index takes it."""
    tag = semver(version)
    release = f"https://github.com/gpuusage/gpuusage/releases/download/{tag}"
    body = {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "gpuusage"},
        "spec": {
            "version": tag,
            "homepage": "https://github.com/gpuusage/gpuusage",
            "shortDescription": "Which pod uses which GPU: memory, compute share, processes",
            "description": (
                "Shows what gpuusage observed on the cluster's GPU nodes: which pod uses which\n"
                "GPU and how much of its memory and compute, against what it was handed\n"
                "(`kubectl gpuusage top`), and every GPU process with its pod, as nvidia-smi\n"
                "lists them on one machine (`kubectl gpuusage ps`). It reads the GpuNodeUsage\n"
                "reports that gpuusage's node agent and operator keep in the cluster.\n"
            ),
            "caveats": (
                "Needs python3 3.11 or later on PATH (CPython 3.11 to 3.14), and gpuusage\n"
                "installed in the cluster (its GpuNodeUsage API). It unpacks itself once into\n"
                "$XDG_CACHE_HOME/gpuusage (~/.cache/gpuusage).\n"
            ),
            "platforms": [
                {
                    "selector": {"matchLabels": {"os": p.os, "arch": p.arch}},
                    "uri": f"{release}/{p.archive}",
                    "sha256": sha256[p],
                    "files": [
                        {"from": "kubectl-gpuusage", "to": "."},
                        {"from": "LICENSE", "to": "."},
                    ],
                    "bin": "kubectl-gpuusage",
                }
                for p in PLATFORMS
            ],
        },
    }
    return yaml.dump(body, Dumper=_BlockDumper, sort_keys=False, width=100)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks (`|`), as krew-index's manifests are written."""


def _block(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_BlockDumper.add_representer(str, _block)


def build(out: Path, repo: Path = REPO) -> dict[Platform, str]:
    """Every platform's archive into `out`; their sha256."""
    lock = (repo / LOCK).read_text()
    license_text = (repo / "LICENSE").read_bytes()
    cache = cache_root() / "wheels"
    out.mkdir(parents=True, exist_ok=True)
    digests: dict[Platform, str] = {}
    with file_lock(cache_root() / "locks" / "wheels.lock"):
        for platform in PLATFORMS:
            entries = _site_entries(wheels_for(platform, lock, cache), repo)
            data = archive(zipapp(entries), license_text)
            (out / platform.archive).write_bytes(data)
            digests[platform] = hashlib.sha256(data).hexdigest()
    return digests


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist")
    parser.add_argument("--manifest", type=Path, default=REPO / MANIFEST)
    args = parser.parse_args(argv)
    digests = build(args.out)
    args.manifest.parent.mkdir(parents=True, exist_ok=True)
    args.manifest.write_text(manifest(digests))
    for platform, digest in digests.items():
        print(f"{args.out / platform.archive}  sha256 {digest}")
    print(f"wrote {args.manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
