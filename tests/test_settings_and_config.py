"""Flags, environment variables and API discovery."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest
from pydantic import Field

from gpuusage.cli import build_parser, main
from gpuusage.kube.config import KubeConfigError, choose_source
from gpuusage.procfs import cmdline, start_ticks
from gpuusage.settings import CommandSettings, SettingsError, add_arguments, resolve
from gpuusage_dev.commands import LocalClusterSettings, RestartSettings


class Example(CommandSettings):
    node_name: str = Field(default="", json_schema_extra={"env": ["NODE_NAME"]})
    """Node name."""
    interval: float = Field(default=10.0, gt=0)
    """Seconds between cycles."""
    once: bool = False
    """One cycle only."""


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_default() -> None:
    env = {"GPUUSAGE_INTERVAL": "5", "GPUUSAGE_NODE_NAME": "from-env", "NODE_NAME": "downward"}
    assert resolve(Example, _parse("--interval", "2"), env).interval == 2.0
    assert resolve(Example, _parse(), env).interval == 5.0
    assert resolve(Example, _parse(), {}).interval == 10.0
    assert resolve(Example, _parse(), env).node_name == "from-env"


def test_extra_environment_names_are_read() -> None:
    assert resolve(Example, _parse(), {"NODE_NAME": "gpu-7"}).node_name == "gpu-7"


def test_booleans_have_a_negative_flag() -> None:
    assert resolve(Example, _parse("--once"), {}).once is True
    assert resolve(Example, _parse("--no-once"), {"GPUUSAGE_ONCE": "true"}).once is False
    assert resolve(Example, _parse(), {"GPUUSAGE_ONCE": "true"}).once is True


def test_bad_values_name_their_origin() -> None:
    with pytest.raises(SettingsError) as caught:
        resolve(Example, _parse(), {"GPUUSAGE_INTERVAL": "-1"})
    assert "$GPUUSAGE_INTERVAL" in str(caught.value)
    assert "greater than 0" in str(caught.value)
    with pytest.raises(SettingsError, match="--interval"):
        resolve(Example, _parse("--interval", "soon"), {})


def test_help_lists_the_environment_variable() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    text = parser.format_help()
    assert "GPUUSAGE_NODE_NAME, NODE_NAME" in text
    assert "GPUUSAGE_INTERVAL" in text


def test_cli_reports_bad_settings_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUUSAGE_TIMEOUT", "0")
    with pytest.raises(SystemExit) as caught:
        main(["local-cluster", "up", "--dir", "/tmp/x"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "$GPUUSAGE_TIMEOUT" in err
    assert "Traceback" not in err


def test_an_outage_is_only_for_the_nodes_parts(capsys: pytest.CaptureFixture[str]) -> None:
    """`--down-for` keeps a node part away; the control plane's restart has no such outage,
    and saying so is refused before anything is stopped."""
    for component in ([], ["--component", "etcd"]):
        with pytest.raises(SystemExit) as caught:
            main(["local-cluster", "restart", "--dir", "/tmp/x", "--down-for", "5", *component])
        assert caught.value.code == 2
        assert "--down-for is for the node's parts" in capsys.readouterr().err
    namespace = build_parser().parse_args(
        ["local-cluster", "restart", "--dir", "/x", "--component", "kubelet", "--down-for", "30"]
    )
    settings = resolve(RestartSettings, namespace, {})
    assert (settings.component, settings.down_for) == ("kubelet", 30.0)


def test_local_cluster_dir_is_required() -> None:
    namespace = build_parser().parse_args(["local-cluster", "down"])
    with pytest.raises(SettingsError, match="--dir"):
        resolve(LocalClusterSettings, namespace, {})


def test_crd_command_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert "name: gpunodeusages.gpuusage.io" in capsys.readouterr().out


def test_api_source_order(tmp_path: Path) -> None:
    token = tmp_path / "token"
    home = tmp_path / "home"
    explicit = tmp_path / "explicit"
    env = {"KUBECONFIG": "/a:/b", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert choose_source(explicit, env, home, token).origin == "flag"
    assert choose_source(None, env, home, token).detail == "/a:/b"
    token.write_text("t")
    assert choose_source(None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, home, token).origin == (
        "in-cluster"
    )
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("{}")
    assert choose_source(None, {}, home, token).origin == "home"


def test_no_api_source_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="pass --kubeconfig, set KUBECONFIG"):
        choose_source(None, {}, tmp_path, tmp_path / "no-token")


def test_start_ticks_survive_odd_process_names(tmp_path: Path) -> None:
    fields = " ".join(str(n) for n in range(3, 53))
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(f"42 (evil) name) (x) {fields}\n")
    assert start_ticks(42, tmp_path) == 22
    assert start_ticks(43, tmp_path) is None
    (tmp_path / "42" / "stat").write_text("42 (truncated) S 1\n")
    assert start_ticks(42, tmp_path) is None


def test_start_ticks_and_cmdline_of_this_process() -> None:
    assert start_ticks(os.getpid()) is not None
    argv = cmdline(os.getpid())
    assert argv
    assert "python" in Path(argv[0]).name


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "crd"],
        ["crd", "--log-level", "DEBUG"],
        ["local-cluster", "down", "--log-level", "DEBUG", "--dir", "/nonexistent-gpuusage"],
    ],
)
def test_log_level_before_or_after_the_command(argv: list[str]) -> None:
    logging.getLogger().handlers.clear()
    assert main(argv) == 0
    assert logging.getLogger().level == logging.DEBUG


def test_log_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    logging.getLogger().handlers.clear()
    monkeypatch.setenv("GPUUSAGE_LOG_LEVEL", "warning")
    assert main(["crd"]) == 0
    assert logging.getLogger().level == logging.WARNING
