"""Every command's --help reads as a person needs it: real defaults as they would be typed,
required flags said to be required, no Python internals."""

from __future__ import annotations

import argparse
import re

import pytest

from gpuusage.cli import COMMANDS, DEVELOPING, Command, _load, build_parser
from gpuusage.settings import CommandSettings, flag_name

LEAKS = re.compile(r"PydanticUndefined|<class |PosixPath\(|frozenset\(|\(\)|\[\]|default None")


def _subparser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in words:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[word]
    return parser


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c.words))
def test_every_commands_help_shows_real_defaults_and_what_is_required(command: Command) -> None:
    shown = " ".join(_subparser(command.words).format_help().split())  # argparse wraps lines
    assert not LEAKS.search(shown), LEAKS.search(shown)
    model: type[CommandSettings] = _load(command.settings)
    for name, info in model.model_fields.items():
        if info.is_required():
            entry = shown[shown.rindex(flag_name(name) + " ") :]  # its entry, not the usage
            assert "required]" in entry[: entry.index("]") + 1], name


def _sections(text: str) -> dict[str, list[str]]:
    """A help text's sections by heading (a line ending in ":"), each with the first word of
    its entries."""
    found: dict[str, list[str]] = {}
    heading = ""
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            heading = line[:-1]
            found[heading] = []
        elif heading and line.startswith("    ") and line[4:5].strip():
            found[heading].append(line.split()[0])
    return found


def test_the_developers_commands_are_listed_apart_from_the_users() -> None:
    """`gpuusage --help` lists what people run under COMMAND and the developers' `demo` and
    `local-cluster` under a heading of their own, which still run as before."""
    sections = _sections(build_parser().format_help())
    users = sections["positional arguments"]
    developers = sections[DEVELOPING]
    assert users == ["agent", "operator", "top", "ps", "crd"]
    assert developers == ["demo", "local-cluster"]
    assert {c.words[0] for c in COMMANDS if c.developing} == set(developers)
    assert DEVELOPING.startswith("for developing gpuusage")
    for words in (["demo", "--dir", "/tmp/d"], ["local-cluster", "up", "--dir", "/tmp/d"]):
        assert build_parser().parse_args(words).run is not None
    group = _subparser(("local-cluster",)).format_help()
    assert _sections(group)["positional arguments"] == ["up", "down", "restart", "build"]
