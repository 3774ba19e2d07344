"""Find or build kube-apiserver, etcd and kubectl at pinned versions.

The project builds its own control plane from Go modules, so tests and the demo run against a
real apiserver without Docker or downloads of prebuilt binaries. Builds are slow the first time
(minutes), so the results are cached outside the repository, keyed by version, and guarded by a
file lock so that parallel callers build once. The envtest convention `KUBEBUILDER_ASSETS`
(a folder holding the three binaries) takes precedence when set.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpuusage.errors import GpuusageError
from gpuusage_dev.localcluster import versions

ETCD_VERSION = "v3.6.5"
MIN_GO = (1, 26)  # Kubernetes 1.37 requires it (its go.mod says go 1.26.0)

Progress = Callable[[str], None]


class BinariesError(GpuusageError):
    """The control-plane binaries are missing and cannot be built here."""


@dataclass(frozen=True)
class Binaries:
    """Paths of the three programs a local control plane needs."""

    kube_apiserver: Path
    etcd: Path
    kubectl: Path


@dataclass(frozen=True)
class NodeBinaries:
    """Paths of the programs a real node of the local cluster adds to the control plane: the
    kubelet, and the scheduler and controller manager that a node's pods need."""

    kubelet: Path
    kube_scheduler: Path
    kube_controller_manager: Path

    @property
    def all(self) -> tuple[Path, ...]:
        return (self.kubelet, self.kube_scheduler, self.kube_controller_manager)


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cache_root() -> Path:
    """Where builds are cached: $GPUUSAGE_CACHE_DIR, else $XDG_CACHE_HOME/gpuusage."""
    explicit = os.environ.get("GPUUSAGE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "gpuusage"


def _kubernetes_dir(root: Path, version: str) -> Path:
    return root / "bin" / f"kubernetes-{version}"


def _etcd_dir(root: Path) -> Path:
    return root / "bin" / f"etcd-{ETCD_VERSION}"


def cached_binaries(root: Path | None = None, version: str | None = None) -> Binaries:
    """The cache paths of `version` (see versions.choose), whether or not the files exist yet."""
    root = root or cache_root()
    kube = _kubernetes_dir(root, versions.choose(version))
    return Binaries(kube / "kube-apiserver", _etcd_dir(root) / "etcd", kube / "kubectl")


def cached_node_binaries(root: Path | None = None, version: str | None = None) -> NodeBinaries:
    """The node programs' cache paths, beside the control plane's of the same version."""
    kube = _kubernetes_dir(root or cache_root(), versions.choose(version))
    return NodeBinaries(kube / "kubelet", kube / "kube-scheduler", kube / "kube-controller-manager")


def absent(paths: tuple[Path, ...]) -> list[Path]:
    return [p for p in paths if not (p.is_file() and os.access(p, os.X_OK))]


def missing_binaries(binaries: Binaries) -> list[Path]:
    return absent((binaries.kube_apiserver, binaries.etcd, binaries.kubectl))


def from_assets(assets: Path) -> Binaries:
    """Binaries from a KUBEBUILDER_ASSETS-style folder; all three must be present."""
    found = Binaries(assets / "kube-apiserver", assets / "etcd", assets / "kubectl")
    missing = missing_binaries(found)
    if missing:
        names = ", ".join(p.name for p in missing)
        raise BinariesError(
            f"KUBEBUILDER_ASSETS={assets} lacks executable {names}; put kube-apiserver, etcd and "
            "kubectl there, or unset KUBEBUILDER_ASSETS to let gpuusage build them"
        )
    return found


def ensure_binaries(progress: Progress = stderr_progress, version: str | None = None) -> Binaries:
    """Return usable binaries of `version` (see versions.choose), building any that are missing
    from the cache."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        return from_assets(Path(assets))
    version = versions.choose(version)
    root = cache_root()
    wanted = cached_binaries(root, version)
    if not missing_binaries(wanted):
        return wanted
    go = require_go(control_plane_hint(version))
    with file_lock(root / "locks" / "build.lock"):
        if wanted.kube_apiserver in missing_binaries(wanted) or wanted.kubectl in missing_binaries(
            wanted
        ):
            build_kubernetes(
                go, version, _kubernetes_dir(root, version), work=root / "work", progress=progress
            )
        if wanted.etcd in missing_binaries(wanted):
            build_etcd(go, _etcd_dir(root), root / "work", progress)
    still = missing_binaries(wanted)
    if still:
        raise BinariesError(f"build finished but {', '.join(map(str, still))} is missing")
    return wanted


def ensure_node_binaries(
    progress: Progress = stderr_progress, version: str | None = None
) -> NodeBinaries:
    """The kubelet, kube-scheduler and kube-controller-manager of `version`, built from
    the same module as kube-apiserver when missing (about 2-3 minutes more once the
    apiserver's build cache is warm; 8 from an empty one)."""
    version = versions.choose(version)
    root = cache_root()
    wanted = cached_node_binaries(root, version)
    if not absent(wanted.all):
        return wanted
    go = require_go(
        f"A local node needs the kubelet, kube-scheduler and kube-controller-manager "
        f"{version}, which gpuusage builds from Go modules once."
    )
    with file_lock(root / "locks" / "build.lock"):
        if absent(wanted.all):
            build_kubernetes(
                go,
                version,
                _kubernetes_dir(root, version),
                work=root / "work",
                progress=progress,
                commands=("kubelet", "kube-scheduler", "kube-controller-manager"),
            )
    still = absent(wanted.all)
    if still:
        raise BinariesError(f"build finished but {', '.join(map(str, still))} is missing")
    return wanted


def control_plane_hint(version: str) -> str:
    return (
        f"gpuusage builds kube-apiserver {version}, kubectl and etcd {ETCD_VERSION} from "
        "Go modules once (about 5 minutes on 2 cores), or set KUBEBUILDER_ASSETS to a folder "
        "holding kube-apiserver, etcd and kubectl."
    )


def require_go(hint: str) -> str:
    """The `go` command, checked for a usable version; the error says how to get one."""
    go = shutil.which("go")
    hint = (
        f"{hint} Builds are cached in {cache_root()}. Install Go >= {MIN_GO[0]}.{MIN_GO[1]} "
        "(https://go.dev/dl/, or your distribution's golang package) and make sure it reaches a "
        "Go module proxy."
    )
    if go is None:
        raise BinariesError("Go toolchain not found on PATH. " + hint)
    try:
        out = subprocess.run(
            [go, "env", "GOVERSION"], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        raise BinariesError(f"`go env GOVERSION` failed ({exc}). " + hint) from exc
    match = re.match(r"go(\d+)\.(\d+)", out)
    if match and (int(match[1]), int(match[2])) < MIN_GO:
        raise BinariesError(f"Go {out} is too old. " + hint)
    return go


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def staging_replaces(kubernetes_go_mod: str, version: str) -> list[str]:
    """`replace` lines that pin kubernetes' staging modules to their published versions.

    k8s.io/kubernetes replaces its staging modules (k8s.io/api, client-go, ...) with local
    folders, which a module that requires it cannot see; each gets the published v0.X.Y.
    """
    staging_version = "v0." + version.removeprefix("v").split(".", 1)[1]
    found = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", kubernetes_go_mod, re.M)
    if not found:
        raise BinariesError("no staging replaces found in k8s.io/kubernetes' go.mod")
    return [f"replace {module} => {module} {staging_version}" for module in sorted(set(found))]


def go_env() -> dict[str, str]:
    """Static binaries, modules resolved from go.mod alone; Go's own caches stay where they are."""
    env = dict(os.environ)
    env.update({"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOWORK": "off"})
    return env


def build_kubernetes(
    go: str,
    version: str,
    dest: Path,
    *,
    work: Path,
    progress: Progress,
    commands: tuple[str, ...] = ("kube-apiserver", "kubectl"),
) -> None:
    """Build `commands` (k8s.io/kubernetes/cmd/...) of `version` into dest."""
    module = work / f"kubernetes-{version}"
    module.mkdir(parents=True, exist_ok=True)
    env = go_env()
    progress(f"gpuusage: resolving k8s.io/kubernetes {version} ...")
    go_mod_path = module_download(go, f"k8s.io/kubernetes@{version}", module, env, "GoMod")
    replaces = staging_replaces(go_mod_path.read_text(), version)
    (module / "go.mod").write_text(
        "module gpuusage.local/kubebuild\n\ngo 1.24.0\n\n"
        f"require k8s.io/kubernetes {version}\n\n" + "\n".join(replaces) + "\n"
    )
    minor = version.split(".")[1]
    ldflags = (
        "-s -w "
        f"-X k8s.io/component-base/version.gitVersion={version} "
        f"-X k8s.io/component-base/version.gitMajor=1 "
        f"-X k8s.io/component-base/version.gitMinor={minor}"
    )
    go_build(
        go,
        module,
        env=env,
        packages=[f"k8s.io/kubernetes/cmd/{name}" for name in commands],
        ldflags=ldflags,
        dest=dest,
        what=f"{', '.join(commands)} {version}",
        progress=progress,
    )


def build_etcd(go: str, dest: Path, work: Path, progress: Progress) -> None:
    """Build etcd of ETCD_VERSION into dest."""
    module = work / f"etcd-{ETCD_VERSION}"
    module.mkdir(parents=True, exist_ok=True)
    (module / "go.mod").write_text(
        "module gpuusage.local/etcdbuild\n\ngo 1.24.0\n\n"
        f"require go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n"
    )
    go_build(
        go,
        module,
        env=go_env(),
        packages=["go.etcd.io/etcd/server/v3"],
        ldflags="-s -w",
        dest=dest,
        what=f"etcd {ETCD_VERSION}",
        progress=progress,
        rename={"server": "etcd"},  # go names it after the path, minus /v3
    )


def ensure_go_program(
    name: str,
    source: Path,
    requires: tuple[str, ...],
    hint: str,
    progress: Progress = stderr_progress,
    *,
    kubernetes: str | None = None,
    replaces: tuple[str, ...] = (),
) -> Path:
    """A one-file Go program of ours (`source`, package main) built against `requires` (module
    and version each), cached by the hash of all it is built from: bin/<name>-<hash>/<name>.
    `kubernetes`: a version of k8s.io/kubernetes it also requires, with its staging modules
    pinned to their published versions (staging_replaces); `replaces`: more `replace` lines
    (`module => module version`), for a dependency whose required version is not served."""
    text = source.read_bytes()
    built_from = [*requires, f"k8s.io/kubernetes {kubernetes}" if kubernetes else "", *replaces]
    key = hashlib.sha256(text + "".join(built_from).encode()).hexdigest()
    root = cache_root()
    wanted = root / "bin" / f"{name}-{key[:12]}" / name
    if absent((wanted,)):
        go = require_go(hint)
        with file_lock(root / "locks" / "build.lock"):
            if absent((wanted,)):
                module = root / "work" / name
                module.mkdir(parents=True, exist_ok=True)
                pinned = list(replaces)
                listed = "".join(f"\t{r}\n" for r in requires)
                if kubernetes:
                    listed += f"\tk8s.io/kubernetes {kubernetes}\n"
                    go_mod = module_download(
                        go, f"k8s.io/kubernetes@{kubernetes}", module, go_env(), "GoMod"
                    )
                    pinned += [
                        line.removeprefix("replace ")
                        for line in staging_replaces(go_mod.read_text(), kubernetes)
                    ]
                replace = "".join(f"replace {r}\n" for r in pinned)
                (module / "go.mod").write_text(
                    f"module gpuusage.local/{name.replace('-', '')}\n\ngo 1.24.0\n\n"
                    f"require (\n{listed})\n" + (f"\n{replace}" if replace else "")
                )
                (module / "main.go").write_bytes(text)
                go_build(
                    go,
                    module,
                    env=go_env(),
                    packages=["."],
                    ldflags="-s -w",
                    dest=wanted.parent,
                    what=f"the {name}",
                    progress=progress,
                    rename={name.replace("-", ""): name},
                )
    if absent((wanted,)):
        raise BinariesError(f"build finished but {wanted} is missing")
    return wanted


def module_download(go: str, module: str, cwd: Path, env: dict[str, str], field: str) -> Path:
    """`go mod download -json MODULE@VERSION`: the path Go reports in `field` (Dir: the
    module's source, GoMod: its go.mod). A failure says what Go said (it reports download
    errors in its JSON on stdout)."""
    cmd = [go, "mod", "download", "-json", module]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    try:
        found = json.loads(proc.stdout)[field] if proc.returncode == 0 else None
    except (ValueError, KeyError, TypeError):
        found = None
    if not isinstance(found, str) or not found:
        said = (proc.stdout + proc.stderr)[-2000:]
        raise BinariesError(f"`go mod download -json {module}` gave no {field} path:\n{said}")
    return Path(found)


def go_build(
    go: str,
    module: Path,
    *,
    env: dict[str, str],
    packages: list[str],
    ldflags: str,
    dest: Path,
    what: str,
    progress: Progress,
    rename: dict[str, str] | None = None,
    tags: str = "",
) -> list[Path]:
    """Run `go build -v`, reporting progress, and move the results into dest atomically.

    The binaries land in a temporary folder first, so an interrupted build never leaves a
    half-written file where the cache lookup would take it for a finished one.
    """
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=dest))
    cmd = [go, "build", "-v", "-ldflags", ldflags, "-o", str(staging) + "/"]
    if tags:
        cmd[2:2] = ["-tags", tags]
    progress(f"gpuusage: building {what} from Go modules (first time only; a few minutes) ...")
    started = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, *packages],
        cwd=module,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tail: list[str] = []
    counts = {"downloads": 0, "packages": 0}

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("go: downloading"):
                counts["downloads"] += 1
            else:
                counts["packages"] += 1
            tail.append(line.rstrip())
            del tail[:-40]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while proc.poll() is None:
        time.sleep(1)
        elapsed = time.monotonic() - started
        if int(elapsed) % 20 == 0 and elapsed >= 20:
            progress(
                f"gpuusage:   ... {what}: {int(elapsed)} s, {counts['downloads']} modules "
                f"downloaded, {counts['packages']} packages compiled"
            )
    reader.join(timeout=5)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise BinariesError(f"building {what} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    built = []
    for produced in sorted(staging.iterdir()):
        final = dest / (rename or {}).get(produced.name, produced.name)
        os.replace(produced, final)
        built.append(final)
    shutil.rmtree(staging, ignore_errors=True)
    progress(f"gpuusage: built {what} in {time.monotonic() - started:.0f} s -> {dest}")
    return built
