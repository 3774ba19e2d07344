"""Finding and building the control-plane binaries, without building anything."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpuusage_dev.localcluster import binaries, tools, versions
from gpuusage_dev.localcluster.binaries import BinariesError

KUBERNETES_GO_MOD_EXCERPT = """
module k8s.io/kubernetes

go 1.24.0

replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/apiextensions-apiserver => ./staging/src/k8s.io/apiextensions-apiserver
	k8s.io/client-go => ./staging/src/k8s.io/client-go
	k8s.io/cri-client => ./staging/src/k8s.io/cri-client
)

require k8s.io/klog/v2 v2.130.1
"""


def test_staging_replaces_pin_published_versions() -> None:
    lines = binaries.staging_replaces(KUBERNETES_GO_MOD_EXCERPT, "v1.34.4")
    assert lines == [
        "replace k8s.io/api => k8s.io/api v0.34.4",
        "replace k8s.io/apiextensions-apiserver => k8s.io/apiextensions-apiserver v0.34.4",
        "replace k8s.io/client-go => k8s.io/client-go v0.34.4",
        "replace k8s.io/cri-client => k8s.io/cri-client v0.34.4",
    ]


def test_staging_replaces_fail_loudly_when_the_format_changes() -> None:
    with pytest.raises(BinariesError, match="no staging replaces"):
        binaries.staging_replaces("module k8s.io/kubernetes\n", "v1.34.4")


def _executable(path: Path) -> None:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_kubebuilder_assets_take_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("kube-apiserver", "etcd", "kubectl"):
        _executable(tmp_path / name)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    found = binaries.ensure_binaries(progress=lambda _: None)
    assert found.kube_apiserver == tmp_path / "kube-apiserver"
    assert found.etcd == tmp_path / "etcd"


def test_kubebuilder_assets_missing_a_binary_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _executable(tmp_path / "etcd")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    with pytest.raises(BinariesError, match="lacks executable kube-apiserver, kubectl"):
        binaries.ensure_binaries(progress=lambda _: None)


def test_missing_go_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.setenv("GPUUSAGE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no go here
    with pytest.raises(BinariesError) as caught:
        binaries.ensure_binaries(progress=lambda _: None)
    message = str(caught.value)
    assert "Go toolchain not found on PATH" in message
    assert "https://go.dev/dl/" in message
    assert "KUBEBUILDER_ASSETS" in message


def test_too_old_go_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_go = tmp_path / "go"
    fake_go.write_text("#!/bin/sh\necho go1.19.2\n")
    fake_go.chmod(0o755)
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.setenv("GPUUSAGE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    with pytest.raises(BinariesError, match=r"Go go1\.19\.2 is too old"):
        binaries.ensure_binaries(progress=lambda _: None)


def test_cache_is_keyed_by_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUUSAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(versions.ENV, raising=False)
    paths = binaries.cached_binaries()
    assert paths.kube_apiserver.parent.name == f"kubernetes-{versions.DEFAULT}"
    assert binaries.cached_binaries(version="1.35").kube_apiserver.parent.name == (
        "kubernetes-v1.35.4"
    )
    monkeypatch.setenv(versions.ENV, "v1.36")
    assert binaries.cached_node_binaries().kubelet.parent.name == "kubernetes-v1.36.3"
    assert paths.etcd.parent.name == f"etcd-{binaries.ETCD_VERSION}"
    assert str(paths.kubectl).startswith(str(tmp_path))


def test_monitoring_tools_prefer_an_explicit_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "promtool"
    _executable(mine)
    monkeypatch.setenv(tools.PROMTOOL.env, str(mine))
    assert tools.ensure_tool(tools.PROMTOOL, progress=lambda _: None) == mine
    monkeypatch.setenv(tools.PROMTOOL.env, str(tmp_path / "nowhere"))
    with pytest.raises(BinariesError, match=r"GPUUSAGE_PROMTOOL=.* is not an executable file"):
        tools.ensure_tool(tools.PROMTOOL, progress=lambda _: None)


def test_monitoring_tools_come_from_the_version_keyed_cache_without_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(tools.KUBE_STATE_METRICS.env, raising=False)
    monkeypatch.setenv("GPUUSAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "no-go-here"))
    cached = tools.KUBE_STATE_METRICS.cached()
    assert cached.parent.name == "kube-state-metrics-v2.13.0"
    with pytest.raises(BinariesError) as caught:  # not cached yet, and no go to build it
        tools.ensure_tool(tools.KUBE_STATE_METRICS, progress=lambda _: None)
    assert "kube-state-metrics v2.13.0" in str(caught.value)
    assert "GPUUSAGE_KUBE_STATE_METRICS" in str(caught.value)
    cached.parent.mkdir(parents=True)
    _executable(cached)
    assert tools.ensure_tool(tools.KUBE_STATE_METRICS, progress=lambda _: None) == cached


def test_a_first_build_says_what_it_makes_and_about_how_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make demo` on a fresh machine: the control plane and the node's programs, not the
    tests' tools; once cached, nothing is said."""
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    for tool in tools.TOOLS:
        monkeypatch.delenv(tool.env, raising=False)
    plan = tools.first_build_plan(node=True, tools=False, root=tmp_path)
    assert plan is not None
    assert "kube-apiserver, etcd, kubectl; kubelet, kube-scheduler" in plan
    assert "containerd" in plan
    assert "about 9.5 minutes on 2 cores" in plan
    assert "promtool" not in plan
    everything = tools.first_build_plan(node=True, tools=True, root=tmp_path)
    assert everything is not None
    assert "promtool" in everything
    assert "about 18 minutes" in everything
    assert "actionlint" in everything
    plane = binaries.cached_binaries(tmp_path)
    made = [
        plane.kube_apiserver,
        plane.etcd,
        plane.kubectl,
        *binaries.cached_node_binaries(tmp_path).all,
        *(tool.cached(tmp_path) for tool in (*tools.TOOLS, tools.CONTAINERD)),
    ]
    for path in made:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    assert tools.first_build_plan(node=True, tools=True, root=tmp_path) is None


@pytest.mark.parametrize(
    ("asked", "runs"),
    [
        (None, versions.DEFAULT),
        ("1.36", "v1.36.3"),
        ("v1.35", "v1.35.4"),
        ("1.37.2", "v1.37.2"),
        ("v1.35.4", "v1.35.4"),
    ],
)
def test_a_supported_minor_names_its_release(asked: str | None, runs: str) -> None:
    assert versions.choose(asked, environ={}) == runs


def test_the_environment_chooses_when_no_flag_does() -> None:
    assert versions.choose(None, environ={versions.ENV: "1.36"}) == "v1.36.3"
    assert versions.choose("1.35", environ={versions.ENV: "1.36"}) == "v1.35.4"


@pytest.mark.parametrize("asked", ["1.34", "v1.34.4", "1.36.9", "1.38", "latest", "2.0"])
def test_an_unsupported_version_is_refused_with_the_list(asked: str) -> None:
    with pytest.raises(versions.UnsupportedVersion) as refused:
        versions.choose(asked, environ={})
    assert asked in str(refused.value)
    assert ", ".join(versions.SUPPORTED) in str(refused.value)


def test_the_newest_supported_release_is_the_default() -> None:
    assert max(versions.SUPPORTED, key=versions.minor) == versions.DEFAULT
    assert min(versions.SUPPORTED, key=versions.minor) == versions.OLDEST
