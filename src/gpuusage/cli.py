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
from functools import partial
from pathlib import Path
from typing import Literal

from pydantic import Field

from gpuusage import __version__
from gpuusage.errors import GpuusageError
from gpuusage.nodeagent.settings import AgentSettings
from gpuusage.operator.settings import OperatorSettings
from gpuusage.settings import CommandSettings, S, SettingsError, add_arguments, resolve
from gpuusage.top import TopSettings

log = logging.getLogger("gpuusage")


class CrdSettings(CommandSettings):
    output: Path | None = None
    """Write the CRD YAML to this file instead of standard output."""
    peering: bool = False
    """Render kopf's ClusterKopfPeering CRD instead (the operator replicas' meeting point)."""


class LocalClusterSettings(CommandSettings):
    dir: Path
    """Folder for the cluster's state, certificates, logs and kubeconfig."""
    install_crds: bool = False
    """After start, install the CRDs (GpuNodeUsage, ClusterKopfPeering) and the operators'
    peering object, and wait until they are established."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for the apiserver's /readyz."""


class RestartSettings(CommandSettings):
    dir: Path
    """Folder of a running local cluster (as given to `up`)."""
    component: Literal["apiserver", "etcd"] | None = None
    """Restart only this component; default both (the apiserver stops first, starts last)."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for the apiserver's /readyz afterwards."""


class BuildSettings(CommandSettings):
    """Versions are pinned in gpuusage.localcluster.binaries and .tools."""

    monitoring: bool = False
    """Also build kube-state-metrics and promtool and fetch the Prometheus Operator's CRDs (the
    monitoring tests use them)."""


class DemoSettings(CommandSettings):
    dir: Path | None = None
    """Folder for the demo cluster; a temporary one by default."""
    keep: bool = False
    """Leave the demo cluster running at the end (stop it with `local-cluster down`)."""


def _run_crd(settings: CrdSettings) -> int:
    from gpuusage.api.crd import render_crd_yaml, render_peering_crd_yaml

    text = render_peering_crd_yaml() if settings.peering else render_crd_yaml()
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
        from gpuusage.kube.crds import install_crds

        api, _ = api_client(cluster.kubeconfig)
        with api:
            install_crds(api)
    print(f"local control plane ready at {cluster.server}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"kubectl: {cluster.binaries.kubectl}")
    print(f"stop it with: gpuusage local-cluster down --dir {settings.dir}")
    return 0


def _run_restart(settings: RestartSettings) -> int:
    from gpuusage.localcluster.cluster import LocalCluster

    cluster = LocalCluster(settings.dir)
    cluster.restart(settings.component, timeout=settings.timeout)
    what = settings.component or "etcd and kube-apiserver"
    print(f"restarted {what}; local control plane ready at {cluster.server}")
    return 0


def _run_build(settings: BuildSettings) -> int:
    from gpuusage.localcluster.binaries import ensure_binaries

    found = ensure_binaries()
    for path in (found.kube_apiserver, found.etcd, found.kubectl):
        print(path)
    if settings.monitoring:
        from gpuusage.localcluster.tools import TOOLS, ensure_tool, monitoring_crds

        for tool in TOOLS:
            print(ensure_tool(tool))
        for crd in monitoring_crds():
            print(crd)
    return 0


def _run_agent(settings: AgentSettings) -> int:
    from gpuusage.nodeagent.main import run_agent

    return run_agent(settings)


def _run_operator(settings: OperatorSettings) -> int:
    from gpuusage.operator.main import run_operator

    return run_operator(settings)


def _run_top(settings: TopSettings) -> int:
    from gpuusage.kube.top import run_top

    return run_top(settings)


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


def _command(
    parent: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    text: str,
    model: type[S],
    run: Callable[[S], int],
) -> None:
    """Register a command whose flags come from `model` and which runs `run(settings)`."""
    sub = parent.add_parser(name, help=text, parents=[_common()])
    add_arguments(sub, model)
    sub.set_defaults(run=lambda ns: run(resolve(model, ns)))


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="gpuusage",
        description="Which pod uses which GPU, and how much memory.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"gpuusage {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _command(commands, "crd", "print the GpuNodeUsage CRD rendered from the models",
             CrdSettings, _run_crd)  # fmt: skip
    local = commands.add_parser(
        "local-cluster",
        help="start or stop a local etcd + kube-apiserver on loopback",
        parents=[common],
    )
    actions = local.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("up", "start and wait until ready"), ("down", "stop everything")):
        _command(actions, action, text, LocalClusterSettings, partial(_run_local_cluster, action))
    _command(actions, "restart",
             "stop and start again on the same ports, certificates and data",
             RestartSettings, _run_restart)  # fmt: skip
    _command(actions, "build",
             "build (or find) kube-apiserver, etcd and kubectl (and with --monitoring "
             "kube-state-metrics and promtool); print their paths",
             BuildSettings, _run_build)  # fmt: skip
    _command(commands, "agent",
             "observe this node's GPUs and publish its GpuNodeUsage (the DaemonSet)",
             AgentSettings, _run_agent)  # fmt: skip
    _command(commands, "operator",
             "resolve reports to pods; write status, pod annotations, conditions and Events",
             OperatorSettings, _run_operator)  # fmt: skip
    _command(commands, "top",
             "pods using GPUs, largest GPU memory first (also: kubectl gpuusage top)",
             TopSettings, _run_top)  # fmt: skip
    _command(commands, "demo",
             "run the whole product on a local control plane, no GPU or cluster needed",
             DemoSettings, _run_demo)  # fmt: skip
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
    except BrokenPipeError:
        # The reader went away (`gpuusage ... | head`): no traceback, and no second error
        # when the interpreter flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except GpuusageError as exc:
        if namespace.log_level == "DEBUG":
            raise
        parser.exit(1, f"gpuusage: {exc}\n")


def kubectl_plugin() -> int:
    """`kubectl gpuusage ...`: kubectl runs kubectl-gpuusage from PATH with the rest of the line."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
