"""`kubectl gpuusage` from Krew: the archives `make plugin` builds, the manifest kept in the
repository that names them, and the real Krew (sigs.k8s.io/krew, built from its Go module)
installing the plugin and running it against the control plane with a python3 that has none of
the project's packages."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from gpuusage_dev.krewplugin import (
    MANIFEST,
    PLATFORMS,
    REPO,
    Platform,
    archive,
    build,
    manifest,
    semver,
    zipapp,
)
from gpuusage_dev.localcluster.cluster import LocalCluster
from gpuusage_dev.localcluster.tools import KREW, ensure_tool
from tests.conftest import CHILD_ENV, WorldFactory, wait_for
from tests.worldview import report

pytestmark = pytest.mark.slow


def test_versions_are_given_as_krew_takes_them() -> None:
    assert semver("0.1.0") == "v0.1.0"
    assert semver("0.1.0.dev0") == "v0.1.0-dev.0"
    assert semver("1.2.3rc4") == "v1.2.3-rc.4"
    with pytest.raises(ValueError, match="no semantic-version form"):
        semver("1.2")


def test_the_same_input_gives_the_same_archive() -> None:
    """Entries sorted, times and owners fixed: the sha256 a manifest names can be rebuilt."""
    first = {"site/b.py": b"b = 1\n", "site/a.py": b"a = 1\n"}
    again = dict(reversed(list(first.items())))
    one, two = archive(zipapp(first), b"licence"), archive(zipapp(again), b"licence")
    assert one == two
    assert archive(zipapp({**first, "site/a.py": b"a = 2\n"}), b"licence") != one
    with tarfile.open(fileobj=io.BytesIO(one)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert members["kubectl-gpuusage"].mode == 0o755
        assert (members["LICENSE"].mtime, members["LICENSE"].uid) == (0, 0)
        application = tar.extractfile("kubectl-gpuusage")
        assert application is not None
        data = application.read()
    assert data.startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(io.BytesIO(data)) as packed:
        assert packed.namelist() == ["BUILD", "__main__.py", "site/a.py", "site/b.py"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Platform, str]]:
    out = tmp_path_factory.mktemp("dist")
    return out, build(out)


def test_the_manifest_in_the_repository_names_the_archives_make_plugin_builds(
    built: tuple[Path, dict[Platform, str]],
) -> None:
    """What krew-index takes: every platform's archive by its sha256, the plugin's binary and
    the LICENSE extracted, the Python it needs in the caveats. `make plugin` rewrites it."""
    out, digests = built
    kept = (REPO / MANIFEST).read_text()
    assert kept == manifest(digests), "stale: run `make plugin`"
    spec = yaml.safe_load(kept)["spec"]
    assert [(p["selector"]["matchLabels"]["os"], p["selector"]["matchLabels"]["arch"])
            for p in spec["platforms"]] == [(p.os, p.arch) for p in PLATFORMS]  # fmt: skip
    for platform in spec["platforms"]:
        assert platform["bin"] == "kubectl-gpuusage"
        assert {"from": "LICENSE", "to": "."} in platform["files"]
    assert "3.11" in spec["caveats"]
    for platform in PLATFORMS:
        with tarfile.open(out / platform.archive) as tar:
            licence = tar.extractfile("LICENSE")
            assert licence is not None
            assert licence.read() == (REPO / "LICENSE").read_bytes()


@pytest.fixture
def bare_python(tmp_path: Path) -> Path:
    """A python3 of this machine with none of the project's packages: what a user has."""
    folder = tmp_path / "bare"
    venv.create(folder, with_pip=False)
    found = subprocess.run(
        [folder / "bin" / "python3", "-c", "import pydantic"], capture_output=True, check=False
    )
    assert found.returncode != 0, "the bare python must not find pydantic"
    return folder / "bin"


@pytest.mark.cluster
def test_krew_installs_the_plugin_that_runs_top_and_ps_and_uninstalls_it(
    built: tuple[Path, dict[Platform, str]],
    make_world: WorldFactory,
    cluster: LocalCluster,
    bare_python: Path,
    tmp_path: Path,
) -> None:
    """Installed from the manifest and this platform's archive, as users install it: the
    plugin runs `top` and `ps` with a python3 that has none of the project's packages, and
    is gone after `kubectl krew uninstall`."""
    out, digests = built
    krew_home = tmp_path / "krew"
    host = next(p for p in PLATFORMS if (p.os, p.arch) == ("linux", _arch()))
    rendered = tmp_path / "gpuusage.yaml"
    rendered.write_text(manifest(digests))
    krew = ensure_tool(KREW)
    kubectl = str(cluster.binaries.kubectl)
    env = {
        **{k: v for k, v in CHILD_ENV.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        "KREW_ROOT": str(krew_home),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PATH": os.pathsep.join([str(krew_home / "bin"), str(krew.parent), str(bare_python),
                                 "/usr/bin", "/bin"]),
    }  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [kubectl, *args], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
            check=False, timeout=120,
        )  # fmt: skip

    # Krew wants its index (a git clone of krew-index) for some commands; this machine reaches
    # no GitHub, so the default index is a local repository that holds this plugin's manifest.
    index = krew_home / "index" / "default"
    (index / "plugins").mkdir(parents=True)
    (index / "plugins" / "gpuusage.yaml").write_text(rendered.read_text())
    git = {**env, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    for step in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "index"]):
        subprocess.run(["git", "-C", str(index), *step], env=git, check=True)
    installed = run("krew", "install", f"--manifest={rendered}", f"--archive={out / host.archive}")
    assert installed.returncode == 0, installed.stderr
    assert "Installed plugin: gpuusage" in installed.stdout + installed.stderr
    assert (krew_home / "bin" / "kubectl-gpuusage").is_symlink()
    assert (krew_home / "receipts" / "gpuusage.yaml").is_file(), "Krew's record of it"

    world = make_world()
    wait_for(lambda: report(world).get("status", {}).get("pods"), what="pods resolved")
    kc = str(cluster.kubeconfig)
    top = run("gpuusage", "top", "-A", "--kubeconfig", kc)
    assert top.returncode == 0, top.stderr
    assert any(line.split()[:2] == [world.ns, "train"] for line in top.stdout.splitlines())
    ps = run("gpuusage", "ps", "-A", "--kubeconfig", kc, "-o", "json")
    assert ps.returncode == 0, ps.stderr
    rows = {i["pid"]: i for i in json.loads(ps.stdout)["items"] if i["node"] == world.node}
    assert (rows[4242]["namespace"], rows[4242]["pod"]) == (world.ns, "train")
    assert rows[777]["no_pod"] == "HostProcess"
    missing = run("gpuusage", "agent")
    assert missing.returncode != 0
    assert "is not in this installation" in missing.stderr, "the plugin carries the commands only"

    removed = run("krew", "uninstall", "gpuusage")
    assert removed.returncode == 0, removed.stderr
    assert not (krew_home / "bin" / "kubectl-gpuusage").exists()
    assert not (krew_home / "receipts" / "gpuusage.yaml").exists()
    assert run("gpuusage", "top").returncode != 0, "kubectl no longer finds the plugin"


def _arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
