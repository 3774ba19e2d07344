"""The product's images without Docker, from the same recipe as their Dockerfiles.

A Dockerfile here says what an image holds: the requirements files its dependencies come from,
the folders it copies, its environment, user, entrypoint and command, and its OCI labels
(`recipe_of` reads those lines, so the two cannot drift; the labels' VERSION and REVISION are
gpuusage.__version__ and the git commit, as a release build passes them). The base is the Debian
release `python:3.11-slim` is built on, bookworm, whose own python3 is the same minor version
(3.11), made with mmdebstrap from the distribution's packages. Three layers: that base, the
dependencies (installed with pip for Python 3.11 into /usr/local/lib/python3.11/dist-packages,
which Debian's python3 reads), and the copied sources; the last two with their bytecode,
compiled as the Dockerfile's `RUN python -m compileall` line says (hash-based, so reproducible).
Each is cached under the project's cache folder by the hash of what makes it, so an image is
rebuilt when its inputs change and only the layers that changed are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster.binaries import Progress, cache_root, file_lock, stderr_progress
from gpuusage_dev.localcluster.images import (
    Image,
    Manifest,
    Platform,
    image_manifest,
    index_archive,
    layer_from_directory,
    single_archive,
)
from gpuusage_dev.localcluster.platforms import HOST, RELEASE_PLATFORMS, cannot_emulate
from gpuusage_dev.lock import PYTHON, WHEEL_PLATFORMS
from gpuusage_dev.version import dockerfile_args, dockerfile_labels, version_of

DEBIAN_RELEASE = "bookworm"  # python:3.11-slim's; its python3 is 3.11
BASE_PACKAGES = ("python3", "python-is-python3", "ca-certificates")
EXCLUDED = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
KEPT = ("/usr/share/doc/*/copyright",)
"""Kept of what EXCLUDED drops: each Debian package's copyright file, its license, which the
SBOM reads and which shipping the package's binaries requires."""
SITE = "usr/local/lib/python3.11/dist-packages"


class ImageBuildError(GpuusageError):
    """An image could not be built here (no mmdebstrap, not root, a failed step)."""


@dataclass(frozen=True)
class Recipe:
    """What a Dockerfile's final image holds, read from its lines."""

    requirements: tuple[str, ...]
    """Requirements files (repository paths) its dependencies are installed from."""
    copies: tuple[tuple[str, str], ...]
    """(repository path, image path) of each COPY of our sources into the final image."""
    env: tuple[str, ...] = ()
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    """LABEL keys and values as written: `${NAME}` names a build argument."""
    args: dict[str, str] = field(default_factory=dict)
    """Each build argument's default (`ARG NAME=default`)."""
    bytecode: str = ""
    """The invalidation mode the Dockerfile's `RUN python -m compileall` compiles with (its
    dependencies and sources); "" where it compiles nothing."""


def recipe_of(dockerfile: str) -> Recipe:
    """The recipe of a Dockerfile of ours (two stages: dependencies, then the image)."""
    requirements: list[str] = []
    copies: list[tuple[str, str]] = []
    env: list[str] = []
    user = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    bytecode = ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if line.startswith("RUN python -m compileall "):
            mode = re.search(r"--invalidation-mode (checked-hash|unchecked-hash)", line)
            if mode is None:
                raise ImageBuildError(
                    "the Dockerfile's compileall needs --invalidation-mode checked-hash (or "
                    "unchecked-hash): timestamped bytecode differs from build to build"
                )
            bytecode = mode[1]
        elif line.startswith("COPY --from="):
            continue
        if line.startswith("COPY "):
            source, dest = line.split()[1:3]
            if source.endswith(("requirements.txt", "requirements.lock")):
                requirements.append(source)
            else:
                copies.append((source, dest))
        elif line.startswith("ENV "):
            env += re.findall(r"(\w+=\S+)", line[4:])
        elif line.startswith("USER "):
            user = line.split()[1]
        elif line.startswith("ENTRYPOINT "):
            entrypoint = tuple(json.loads(line.split(" ", 1)[1]))
        elif line.startswith("CMD "):
            cmd = tuple(json.loads(line.split(" ", 1)[1]))
    if not requirements or not copies or not entrypoint:
        raise ImageBuildError("the Dockerfile has no requirements, COPY or ENTRYPOINT lines")
    labels, args = dockerfile_labels(dockerfile), dockerfile_args(dockerfile)
    return Recipe(
        tuple(requirements),
        tuple(copies),
        tuple(env),
        user,
        entrypoint,
        cmd,
        labels,
        args,
        bytecode,
    )


def expand(labels: dict[str, str], args: dict[str, str]) -> dict[str, str]:
    """The labels with each `${NAME}` replaced by its build argument, as `docker build` does."""
    return {
        key: re.sub(r"\$\{(\w+)\}", lambda found: args.get(found[1], ""), value)
        for key, value in labels.items()
    }


def git_output(repo: Path, *args: str) -> str | None:
    """What git prints for `args` in the checkout at `repo`, or None outside git. The
    repository is trusted explicitly, so a build as root in a checkout another user owns (CI
    under sudo) still reads it."""
    try:
        found = subprocess.run(
            ["git", "-c", f"safe.directory={repo.resolve()}", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def git_revision(repo: Path) -> str:
    """The commit checked out at `repo`, or "unknown" outside git (a source archive)."""
    revision = git_output(repo, "rev-parse", "--verify", "--quiet", "HEAD") or ""
    return revision if re.fullmatch(r"[0-9a-f]{40,64}", revision) else "unknown"


def image_labels(repo: Path, recipe: Recipe) -> dict[str, str]:
    """The image's OCI labels as a release build sets them: VERSION from gpuusage.__version__
    (of the checkout at `repo`), REVISION its git commit. Nothing from the clock, so the same
    commit gives the same bytes."""
    args = {**recipe.args, "VERSION": version_of(repo), "REVISION": git_revision(repo)}
    return expand(recipe.labels, args)


def _hash(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def _tree_bytes(root: Path) -> bytes:
    """Every file below `root` (paths and contents) as one byte string, for hashing."""
    found = b""
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            found += str(path.relative_to(root)).encode() + b"\0" + path.read_bytes()
    return found


BASE_EPOCH = 1686355200
"""The base's one clock (2023-06-10, Debian 12's release), as SOURCE_DATE_EPOCH for
mmdebstrap and the packages' scripts (the dates in /etc/shadow, for one): fixed, so the base does
not change with the day it is made, nor with the commit. With it, Debian's py3compile writes
hash-based bytecode: timestamped bytecode would be stale once the layer gives every file one
time, and each start would compile the standard library again."""
HOST_FILES = ("etc/hostname", "etc/resolv.conf")
"""What mmdebstrap copies from the machine that builds the base: removed, so no image carries
the builder's name or its DNS."""


def base_key(platform: Platform) -> str:
    """Everything that makes the base for `platform`."""
    return _hash(
        DEBIAN_RELEASE.encode(),
        platform.architecture.encode(),
        " ".join(BASE_PACKAGES).encode(),
        str(EXCLUDED).encode(),
        str(KEPT).encode(),
        str(BASE_EPOCH).encode(),
        str(HOST_FILES).encode(),
    )


def base_layer(platform: Platform = HOST, progress: Progress = stderr_progress) -> bytes:
    """The Debian base for `platform` as a layer, made once with mmdebstrap (as root, from
    Debian's packages; another CPU's packages run their scripts under qemu)."""
    arch = platform.architecture
    cached = cache_root() / "images" / f"base-{DEBIAN_RELEASE}-{arch}-{base_key(platform)}.tar"
    if cached.exists():
        return cached.read_bytes()
    if shutil.which("mmdebstrap") is None:
        raise ImageBuildError("mmdebstrap not found: apt-get install mmdebstrap")
    why = cannot_emulate(platform)
    if why is not None:
        raise ImageBuildError(why)
    with file_lock(cache_root() / "locks" / "images.lock"):
        if cached.exists():
            return cached.read_bytes()
        progress(
            f"gpuusage: making a Debian {DEBIAN_RELEASE} {arch} base with mmdebstrap (once; "
            f"{'about a minute' if platform == HOST else 'about 8 minutes under qemu'}) ..."
        )
        with tempfile.TemporaryDirectory(prefix="gpuusage-base-") as work:
            rootfs = Path(work) / "rootfs"
            options = [f"--dpkgopt=path-exclude={p}" for p in EXCLUDED]
            options += [f"--dpkgopt=path-include={p}" for p in KEPT]
            run = subprocess.run(
                [
                    "mmdebstrap",
                    "--variant=minbase",
                    f"--architectures={arch}",
                    f"--include={','.join(BASE_PACKAGES)}",
                    "--mode=root",
                    *options,
                    DEBIAN_RELEASE,
                    str(rootfs),
                ],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "SOURCE_DATE_EPOCH": str(BASE_EPOCH)},
            )
            if run.returncode != 0:
                raise ImageBuildError(f"mmdebstrap failed:\n{run.stderr[-2000:]}")
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                shutil.rmtree(rootfs / leftover, ignore_errors=True)
            for copied in HOST_FILES:
                (rootfs / copied).unlink(missing_ok=True)
            layer = layer_from_directory(rootfs)
        cached.parent.mkdir(parents=True, exist_ok=True)
        staged = cached.with_suffix(".new")
        staged.write_bytes(layer)
        staged.replace(cached)
    return layer


IMAGE_PYTHON = tuple(int(part) for part in PYTHON.split("."))
"""Debian bookworm's python3, the images' interpreter, whose wheels the lock pins
(lock.PYTHON): their bytecode is this version's."""


def _image_python() -> str:
    """An interpreter here of the images' Python version, to compile their bytecode."""
    if sys.version_info[:2] == IMAGE_PYTHON:
        return sys.executable
    found = shutil.which(f"python{PYTHON}")
    if found is None:
        raise ImageBuildError(
            f"the images run Python {PYTHON}; compiling their bytecode needs it here "
            f"(python{PYTHON} on PATH)"
        )
    return found


def compile_bytecode(root: Path, image_path: str, mode: str) -> None:
    """Compile every module below `root`, which the image holds at `image_path`, as the
    Dockerfile's `RUN python -m compileall` does: its invalidation `mode` hash-based, so the
    bytes depend on the sources only."""
    run = subprocess.run(
        [
            *(_image_python(), "-m", "compileall", "-q", "-j", "0"),
            *("--invalidation-mode", mode, "-s", str(root), "-p", image_path, str(root)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise ImageBuildError(f"compileall failed below {image_path}:\n{run.stdout[-2000:]}")


DEPENDENCIES_MAKING = "pip --target --no-compile, scripts dropped (drop_scripts), compileall"
"""How the dependencies' layer is made, in its cache key: changed with the making, so no layer
made the old way is taken for one made the new way."""


def drop_scripts(target: Path) -> None:
    """Remove the console scripts pip made in `target`/bin, and their lines in each
    distribution's RECORD: their first line names the interpreter pip ran under (this
    checkout's virtualenv), so they would make the layer differ from one checkout to the
    next; the images run `python -m gpuusage` and need none."""
    shutil.rmtree(target / "bin", ignore_errors=True)
    for record in target.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.startswith("../../bin/")]
        if kept != lines:
            record.write_text("".join(kept))


def dependencies_key(repo: Path, recipe: Recipe, platform: Platform) -> str:
    """Everything that makes the dependencies' layer for `platform`."""
    texts = [(repo / r).read_bytes() for r in recipe.requirements]
    wheels = WHEEL_PLATFORMS.get(platform.architecture, "")
    return _hash(
        *texts,
        recipe.bytecode.encode(),
        wheels.encode(),
        PYTHON.encode(),
        DEPENDENCIES_MAKING.encode(),
    )


def dependencies_layer(repo: Path, recipe: Recipe, platform: Platform = HOST) -> bytes:
    """The recipe's requirements, installed by pip for Python 3.11 on `platform` (its wheels,
    as the lock names them) into Debian's local site."""
    wheels = WHEEL_PLATFORMS.get(platform.architecture)
    if wheels is None:
        raise ImageBuildError(f"no wheels are locked for {platform}: {sorted(WHEEL_PLATFORMS)}")
    cached = (
        cache_root()
        / "images"
        / f"deps-{platform.architecture}-{dependencies_key(repo, recipe, platform)}.tar"
    )
    if cached.exists():
        return cached.read_bytes()
    with tempfile.TemporaryDirectory(prefix="gpuusage-deps-") as work:
        target = Path(work) / "site"
        args = [arg for r in recipe.requirements for arg in ("-r", str(repo / r))]
        if any(r.endswith(".lock") for r in recipe.requirements):
            args = ["--require-hashes", "--no-deps", *args]  # as the Dockerfile installs it
        run = subprocess.run(
            [
                *(sys.executable, "-m", "pip", "install", "-q", "--no-compile"),
                *("--target", str(target), "--python-version", PYTHON),
                "--only-binary=:all:",
                *("--platform", wheels),
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise ImageBuildError(f"pip could not install {recipe.requirements}:\n{run.stderr}")
        drop_scripts(target)
        if recipe.bytecode:
            compile_bytecode(target, f"/{SITE}", recipe.bytecode)
        layer = layer_from_directory(target, SITE)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(layer)
    return layer


def sources_layer(repo: Path, recipe: Recipe, mtime: int = 0) -> bytes:
    """The recipe's copied sources, each file's time `mtime` (the commit's)."""
    with tempfile.TemporaryDirectory(prefix="gpuusage-app-") as work:
        root = Path(work)
        for source, dest in recipe.copies:
            target = root / dest.lstrip("/")
            if (repo / source).is_file():  # a file, as the LICENSE
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(repo / source, target)
                continue
            shutil.copytree(
                repo / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        if recipe.bytecode:
            compile_bytecode(root, "/", recipe.bytecode)
        return layer_from_directory(root, mtime=mtime)


def commit_time(repo: Path) -> int:
    """The checked-out commit's time (seconds since 1970), the one clock an image takes: its
    `created` and its sources' file times; 0 outside git."""
    text = git_output(repo, "log", "-1", "--format=%ct", "HEAD") or ""
    return int(text) if text.isdigit() else 0


def rfc3339(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def platform_manifest(
    repo: Path, dockerfile: str, name: str, platform: Platform, progress: Progress
) -> Manifest:
    """The image `dockerfile` (a repository path) describes, for one platform: the Debian base,
    the locked dependencies, the sources, timed by the commit."""
    recipe = recipe_of((repo / dockerfile).read_text())
    when = commit_time(repo)
    layers = [
        base_layer(platform, progress),
        dependencies_layer(repo, recipe, platform),
        sources_layer(repo, recipe, when),
    ]
    image = Image(
        name,
        {},
        entrypoint=recipe.entrypoint,
        cmd=recipe.cmd,
        env=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *recipe.env),
        user=recipe.user,
        labels=image_labels(repo, recipe),
    )
    return image_manifest(image, layers, platform, rfc3339(when), compress=True)


def _cached_build(
    repo: Path, dockerfile: str, name: str, platforms: tuple[Platform, ...], index: bool
) -> Path:
    """Where the build of these inputs is cached: keyed by everything that makes it; a
    release's indexes apart from the node's one-platform images, each kept KEEP_BUILDS deep."""
    text = (repo / dockerfile).read_bytes()
    recipe = recipe_of(text.decode())
    sources = b"".join(_tree_bytes(repo / s) for s, _ in recipe.copies)
    requirements = b"".join((repo / r).read_bytes() for r in recipe.requirements)
    layers = [(base_key(p), dependencies_key(repo, recipe, p)) for p in platforms]
    stamp = json.dumps(
        [image_labels(repo, recipe), commit_time(repo), [str(p) for p in platforms], layers, "gzip"]
    ).encode()
    key = _hash(text, sources, requirements, name.encode(), DEBIAN_RELEASE.encode(), stamp)
    kind = "_index" if index else ""
    return cache_root() / "images" / f"{name.replace('/', '_').replace(':', '_')}{kind}-{key}.tar"


def product_image(
    repo: Path, dockerfile: str, name: str, progress: Progress = stderr_progress
) -> bytes:
    """The OCI archive of the image `dockerfile` (a repository path) describes, named `name`,
    for this machine's CPU: the same manifest a release's index names for it. Cached by
    everything that makes it."""
    cached = _cached_build(repo, dockerfile, name, (HOST,), index=False)
    if cached.exists():
        return cached.read_bytes()
    built = platform_manifest(repo, dockerfile, name, HOST, progress)
    return _keep(cached, single_archive(name, built), name, progress)


def release_image(
    repo: Path,
    dockerfile: str,
    name: str,
    platforms: tuple[Platform, ...] = RELEASE_PLATFORMS,
    progress: Progress = stderr_progress,
) -> bytes:
    """The OCI archive of the image for every platform of a release: one image index naming
    each platform's manifest."""
    cached = _cached_build(repo, dockerfile, name, platforms, index=True)
    if cached.exists():
        return cached.read_bytes()
    built = [platform_manifest(repo, dockerfile, name, p, progress) for p in platforms]
    return _keep(cached, index_archive(name, built), name, progress)


def _keep(cached: Path, archive: bytes, name: str, progress: Progress) -> bytes:
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(archive)
    progress(f"gpuusage: built image {name} ({len(archive) // 2**20} MiB)")
    prune(cached, KEEP_BUILDS)
    return archive


KEEP_BUILDS = 3
"""Builds of one image kept in the cache (the newest): a few checkouts can share the cache
without rebuilding each other's, and a day of edits does not fill the disk."""


def prune(cached: Path, keep: int) -> list[Path]:
    """Remove all but the `keep` newest builds of the image `cached` is one build of (the same
    name before the key); the removed."""
    prefix = cached.name.rsplit("-", 1)[0] + "-"
    builds = [
        p for p in cached.parent.glob(f"{prefix}*.tar") if p.name.rsplit("-", 1)[0] + "-" == prefix
    ]
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = [p for p in builds[keep:] if p != cached]
    for old in removed:
        old.unlink(missing_ok=True)
    return removed


REPO = Path(__file__).resolve().parents[3]
"""The repository this module sits in (an editable install or a checkout); an installed wheel
carries no Dockerfiles."""


def product_images(repo: Path = REPO) -> dict[str, str]:
    """Image name (as the manifests name it, from manifests/base/kustomization.yaml's images)
    → the Dockerfile that builds it."""
    import yaml  # noqa: PLC0415

    kustomization = yaml.safe_load((repo / "manifests/base/kustomization.yaml").read_text())
    found = {}
    for entry in kustomization["images"]:
        name = f"{entry.get('newName', entry['name'])}:{entry['newTag']}"
        part = "nodeagent" if entry["name"].endswith("-agent") else "operator"
        found[name] = f"{part}/Dockerfile"
    return found
