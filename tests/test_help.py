"""Every command's --help reads as a person needs it: real defaults as they would be typed,
required flags said to be required, no Python internals."""

from __future__ import annotations

import argparse
import re

import pytest

from gpuusage.cli import COMMANDS, Command, _load, build_parser
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
