"""The `gpuusage` command: a table of contents that parses flags and hands off to a part.

Each command names its settings model and its entry function by import path, inside the part
that owns it (the agent, the operator, the people's commands, the development tools). Parts are
imported on use, so `gpuusage --help` stays fast, and an image that carries one part runs its
command while the others say plainly that they are not installed there. The developers'
commands (`demo`, `local-cluster`) work as the others but are listed apart in `gpuusage --help`,
under a heading saying whom they are for, so that a user's list holds only what a user runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuusage import __version__
from gpuusage.errors import GpuusageError
from gpuusage.settings import CommandSettings, SettingsError, add_arguments, resolve

log = logging.getLogger("gpuusage")


@dataclass(frozen=True)
class Command:
    """One command: where its settings and its entry function live."""

    words: tuple[str, ...]
    help: str
    settings: str
    """`module:Class` of its settings model."""
    run: str
    """`module:function` taking the settings and returning the exit code."""
    developing: bool = False
    """For people who work on gpuusage, not for those who run or use it: `gpuusage --help`
    lists it apart, under DEVELOPING."""


DEV = "gpuusage_dev.commands"
COMMANDS = (
    Command(
        ("agent",),
        "observe this node's GPUs and publish its GpuNodeUsage (the DaemonSet)",
        "gpuusage_nodeagent.settings:AgentSettings",
        "gpuusage_nodeagent.main:run_agent",
    ),
    Command(
        ("operator",),
        "resolve reports to pods; write status, pod annotations, conditions and Events",
        "gpuusage_operator.settings:OperatorSettings",
        "gpuusage_operator.main:run_operator",
    ),
    Command(
        ("top",),
        "pods using GPUs, largest GPU memory first (also: kubectl gpuusage top)",
        "gpuusage_commands.top:TopSettings",
        "gpuusage_commands.top:run_top",
    ),
    Command(
        ("ps",),
        "every GPU process: node, device, pid, command, pod, memory, share, activity (also: "
        "kubectl gpuusage ps)",
        "gpuusage_commands.ps:PsSettings",
        "gpuusage_commands.ps:run_ps",
    ),
    Command(
        ("crd",),
        "print the GpuNodeUsage CRD rendered from the models",
        "gpuusage_commands.crd:CrdSettings",
        "gpuusage_commands.crd:run_crd",
    ),
    Command(
        ("demo",),
        "run the whole product on a local control plane, no GPU or cluster needed",
        f"{DEV}:DemoSettings",
        f"{DEV}:run_demo",
        developing=True,
    ),
    Command(
        ("local-cluster", "up"),
        "start and wait until ready",
        f"{DEV}:LocalClusterSettings",
        f"{DEV}:run_up",
        developing=True,
    ),
    Command(
        ("local-cluster", "down"),
        "stop everything",
        f"{DEV}:LocalClusterSettings",
        f"{DEV}:run_down",
        developing=True,
    ),
    Command(
        ("local-cluster", "restart"),
        "stop and start again on the same ports, certificates and data",
        f"{DEV}:RestartSettings",
        f"{DEV}:run_restart",
        developing=True,
    ),
    Command(
        ("local-cluster", "build"),
        "build (or find) kube-apiserver, etcd and kubectl (and with --tools "
        "kube-state-metrics, promtool, Prometheus and helm; with --node the kubelet, "
        "kube-scheduler and kube-controller-manager); print their paths",
        f"{DEV}:BuildSettings",
        f"{DEV}:run_build",
        developing=True,
    ),
)
GROUPS = {"local-cluster": "start or stop a local etcd + kube-apiserver on loopback"}
DEVELOPING = "for developing gpuusage (not needed to run or use it)"


def _load(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _part(target: str) -> str:
    return target.partition(":")[0].partition(".")[0]


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


def _missing(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(_namespace: argparse.Namespace) -> int:
        raise GpuusageError(
            f"`gpuusage {' '.join(command.words)}` is not in this installation (its part "
            f"{_part(command.run)} is absent: each image carries only its own part); "
            "`pip install gpuusage` installs every command"
        )

    return run


def _add(
    parent: argparse._SubParsersAction[argparse.ArgumentParser],
    word: str,
    text: str,
    common: argparse.ArgumentParser,
    *,
    apart: bool,
) -> argparse.ArgumentParser:
    """A subcommand, listed with its help in its parent's listing, or not at all there: one
    listed apart (a developers' command at the top, see _developers). Not help=SUPPRESS, which
    Python 3.11's argparse prints as such."""
    if apart:
        return parent.add_parser(word, parents=[common])
    return parent.add_parser(word, help=text, parents=[common])


def _developers(width: int) -> str:
    """The developers' commands, under their own heading below the users', laid out as argparse
    lays out the users'."""
    lines = [f"{DEVELOPING}:"]
    for word in dict.fromkeys(c.words[0] for c in COMMANDS if c.developing):
        text = GROUPS.get(word) or next(c.help for c in COMMANDS if c.words == (word,))
        lines.append(
            textwrap.fill(
                text,
                width,
                initial_indent=f"    {word:<{HELP_COLUMN - 5}} ",
                subsequent_indent=" " * HELP_COLUMN,
            )
        )
    return "\n".join(lines)


HELP_COLUMN = 24
"""Where argparse starts a command's help in the listing (its max_help_position)."""


def _register(
    parent: argparse._SubParsersAction[argparse.ArgumentParser],
    command: Command,
    common: argparse.ArgumentParser,
) -> None:
    """One subcommand whose flags come from its settings model, or a stub naming what is absent."""
    apart = command.developing and len(command.words) == 1
    sub = _add(parent, command.words[-1], command.help, common, apart=apart)
    try:
        model: type[CommandSettings] = _load(command.settings)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != _part(command.settings):
            raise
        sub.set_defaults(run=_missing(command))
        return

    def run(namespace: argparse.Namespace) -> int:
        entry: Callable[[CommandSettings], int] = _load(command.run)
        return entry(resolve(model, namespace))

    add_arguments(sub, model)
    sub.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    width = shutil.get_terminal_size().columns - 2  # as argparse's own formatter
    parser = argparse.ArgumentParser(
        prog="gpuusage",
        description="Which pod uses which GPU, and how much memory.",
        epilog=_developers(width),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"gpuusage {__version__}")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for command in COMMANDS:
        parent = top
        if len(command.words) == 2:
            group = command.words[0]
            if group not in groups:
                holder = _add(top, group, GROUPS[group], common, apart=command.developing)
                groups[group] = holder.add_subparsers(
                    dest="action", required=True, metavar="ACTION"
                )
            parent = groups[group]
        _register(parent, command, common)
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
