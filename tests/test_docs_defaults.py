"""Every default the README and docs/ give a flag is the flag's default in the code: a flag
named in backticks with a number in parentheses right after it (`--stale-after` (180 s)), and
each row of the README's table of settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gpuusage.settings import CommandSettings, flag_name
from gpuusage_commands.crd import CrdSettings
from gpuusage_commands.ps import PsSettings
from gpuusage_commands.top import TopSettings
from gpuusage_dev.commands import BuildSettings, DemoSettings, LocalClusterSettings
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.settings import OperatorSettings
from tests.test_docs import DOCUMENTS, FENCE, ROOT

COMMANDS: dict[str, type[CommandSettings]] = {
    "operator": OperatorSettings,
    "agent": AgentSettings,
    "top": TopSettings,
    "ps": PsSettings,
    "crd": CrdSettings,
    "local-cluster": LocalClusterSettings,
    "build": BuildSettings,
    "demo": DemoSettings,
}
NAMED = re.compile(
    r"`(--[a-z0-9-]+)`[^`|\n]{0,3}\((\d+(?:\.\d+)?)(?=\)|;|,| s\b| seconds\b| minutes?\b| MiB\b)"
    r"( minutes?\b)?"
)
"""A flag and the number in parentheses right after it, in seconds where given in minutes."""
ROW = re.compile(r"^\| ((?:(?:operator|agent) )?`--[^|]+) \| ([^|]*) \|", re.M)


def _defaults(flag: str, command: str | None = None) -> list[Any]:
    """The flag's default in each command that has it (in `command`'s alone where named)."""
    found = []
    for name, model in COMMANDS.items():
        if command is not None and name != command:
            continue
        for field, info in model.model_fields.items():
            if flag_name(field) == flag and not info.is_required():
                found.append(info.default)
    return found


def _same(default: Any, said: str) -> bool:
    said = said.strip().strip("`")
    if isinstance(default, bool):
        return said == ("on" if default else "off")
    if isinstance(default, int | float):
        number = re.fullmatch(r"(\d+(?:\.\d+)?)( s| MiB)?", said)
        return number is not None and float(number[1]) == float(default)
    return said == str(default)


def named_defaults(text: str) -> list[str]:
    """Where the text gives a flag a default the code does not have."""
    wrong = []
    for match in NAMED.finditer(FENCE.sub("", text)):
        flag, number = match[1], float(match[2]) * (60 if match[3] else 1)
        defaults = _defaults(flag)
        if not defaults:
            wrong.append(f"{flag}: no command has it")
        elif not any(isinstance(d, int | float) and float(d) == number for d in defaults):
            wrong.append(f"{flag} ({match[2]}{match[3] or ''}): the code's default is {defaults}")
    return wrong


def table_defaults(text: str) -> list[str]:
    """Where a row of the table of settings gives a flag a default the code does not have:
    `| operator `--a`, `--b` | 1, 2 | ...`; a row whose defaults do not pair with its flags
    (one setting of two commands) is not read."""
    wrong = []
    for match in ROW.finditer(text):
        command = match[1].split(" ", 1)[0] if not match[1].startswith("`") else None
        flags = re.findall(r"`(--[a-z0-9-]+)`", match[1])
        said = [s for s in match[2].split(", ") if s.strip()] if "…" not in match[2] else []
        if len(said) != len(flags):
            continue
        for flag, value in zip(flags, said, strict=True):
            defaults = _defaults(flag, command)
            if not any(_same(d, value) for d in defaults):
                wrong.append(f"{command} {flag} | {value}: the code's default is {defaults}")
    return wrong


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_default_a_document_gives_a_flag_is_the_codes(document: Path) -> None:
    assert named_defaults(document.read_text()) == []


def test_the_readmes_table_of_settings_gives_the_codes_defaults() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(ROW.findall(text)) >= 10  # the table is read
    assert table_defaults(text) == []


def test_the_default_checks_can_fail() -> None:
    assert named_defaults("stale after `--stale-after` (120 s) without a sign") == [
        "--stale-after (120): the code's default is [180.0]"
    ]
    assert named_defaults("`--policy-notice` (4 minutes)") != []
    assert named_defaults("`--policy-notice` (5 minutes), `--workers` (16)") == []
    assert named_defaults("`--no-such-flag` (3)") == ["--no-such-flag: no command has it"]
    row = "| operator `--pod-writes-per-second`, `--pod-write-burst` | 50, 400 | budget |"
    assert table_defaults(row) == ["operator --pod-write-burst | 400: the code's default is [500]"]
    assert table_defaults("| agent `--idle-after` | 1800 s | x |") != []  # the operator's
