"""The `gpuusage` command: parses flags, logs the effective settings, hands off.

Each subcommand has one settings model (see gpuusage.settings); the work lives in the modules
named after it, so this file stays a table of contents.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import Field

from gpuusage import __version__
from gpuusage.errors import GpuusageError
from gpuusage.settings import CommandSettings, SettingsError, add_arguments, resolve

log = logging.getLogger("gpuusage")


class CrdSettings(CommandSettings):
    output: Path | None = None
    """Write the CRD YAML to this file instead of standard output."""


class LocalClusterSettings(CommandSettings):
    dir: Path
    """Folder for the cluster's state, certificates, logs and kubeconfig."""
    install_crds: bool = False
    """After start, install the GpuNodeUsage CRD and wait until it is established."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for the apiserver's /readyz."""


class BuildSettings(CommandSettings):
    """No options: versions are pinned in gpuusage.localcluster.binaries."""


class DemoSettings(CommandSettings):
    dir: Path | None = None
    """Folder for the demo cluster; a temporary one by default."""
    keep: bool = False
    """Leave the demo cluster running at the end (stop it with `local-cluster down`)."""


def _run_crd(settings: CrdSettings) -> int:
    from gpuusage.api.crd import render_crd_yaml

    text = render_crd_yaml()
    if settings.output is None:
        sys.stdout.write(text)
    else:
        settings.output.parent.mkdir(parents=True, exist_ok=True)
        settings.output.write_text(text)
    return 0


def _run_local_cluster(action: str, settings: LocalClusterSettings) -> int:
    from gpuusage.localcluster.cluster import LocalCluster

    cluster = LocalCluster(settings.dir)
    if action == "down":
        stopped = cluster.down()
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in stopped) or "nothing was running"
        print(f"stopped: {names}")
        return 0
    cluster.up(timeout=settings.timeout)
    if settings.install_crds:
        from gpuusage.kube.config import api_client
        from gpuusage.kube.crds import install_crd

        api, _ = api_client(cluster.kubeconfig)
        with api:
            install_crd(api)
    print(f"local control plane ready at {cluster.server}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"kubectl: {cluster.binaries.kubectl}")
    print(f"stop it with: gpuusage local-cluster down --dir {settings.dir}")
    return 0


def _run_build(settings: BuildSettings) -> int:
    from gpuusage.localcluster.binaries import ensure_binaries

    del settings
    found = ensure_binaries()
    for path in (found.kube_apiserver, found.etcd, found.kubectl):
        print(path)
    return 0


def _run_agent(namespace: argparse.Namespace) -> int:
    from gpuusage.nodeagent.main import AgentSettings, run_agent

    return run_agent(resolve(AgentSettings, namespace))


def _run_demo(settings: DemoSettings) -> int:
    from gpuusage.demo import run_demo

    return run_demo(settings.dir, keep=settings.keep)


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _common() -> argparse.ArgumentParser:
    """Options every command takes, before or after its name."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help="log verbosity [env GPUUSAGE_LOG_LEVEL; default INFO]",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="gpuusage",
        description="Which pod uses which GPU, and how much memory.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"gpuusage {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = commands.add_parser(
        "crd", help="print the GpuNodeUsage CRD rendered from the models", parents=[common]
    )
    add_arguments(crd, CrdSettings)
    crd.set_defaults(run=lambda ns: _run_crd(resolve(CrdSettings, ns)))

    local = commands.add_parser(
        "local-cluster",
        help="start or stop a local etcd + kube-apiserver on loopback",
        parents=[common],
    )
    actions = local.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("up", "start and wait until ready"), ("down", "stop everything")):
        sub = actions.add_parser(action, help=text, parents=[common])
        add_arguments(sub, LocalClusterSettings)
        sub.set_defaults(
            run=lambda ns, a=action: _run_local_cluster(a, resolve(LocalClusterSettings, ns))
        )
    build = actions.add_parser(
        "build",
        help="build (or find) kube-apiserver, etcd and kubectl; print their paths",
        parents=[common],
    )
    add_arguments(build, BuildSettings)
    build.set_defaults(run=lambda ns: _run_build(resolve(BuildSettings, ns)))

    from gpuusage.nodeagent.main import AgentSettings

    agent = commands.add_parser(
        "agent",
        help="observe this node's GPUs and publish its GpuNodeUsage (the DaemonSet)",
        parents=[common],
    )
    add_arguments(agent, AgentSettings)
    agent.set_defaults(run=_run_agent)

    demo = commands.add_parser(
        "demo",
        help="run the whole product on a local control plane, no GPU or cluster needed",
        parents=[common],
    )
    add_arguments(demo, DemoSettings)
    demo.set_defaults(run=lambda ns: _run_demo(resolve(DemoSettings, ns)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    level = getattr(namespace, "log_level", None) or os.environ.get("GPUUSAGE_LOG_LEVEL", "INFO")
    if level.upper() not in LOG_LEVELS:
        parser.exit(2, f"gpuusage: $GPUUSAGE_LOG_LEVEL must be one of {LOG_LEVELS}\n")
    namespace.log_level = level.upper()
    logging.basicConfig(
        level=namespace.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run: Callable[[argparse.Namespace], int] = namespace.run
    try:
        return run(namespace)
    except SettingsError as exc:
        parser.exit(2, f"gpuusage: {exc}\n")
    except KeyboardInterrupt:
        return 130
    except GpuusageError as exc:
        if namespace.log_level == "DEBUG":
            raise
        parser.exit(1, f"gpuusage: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
