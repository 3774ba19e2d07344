"""docs/design.md's table of who writes what is held to the code: every module of the operator
and the agent that sends an API write is in it, and every module it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
ROOTS = (REPO / "operator" / "gpuusage_operator", REPO / "nodeagent" / "gpuusage_nodeagent")
WRITE_CALL = re.compile(
    r"(?<!asyncio)\.(?:patch|create|delete|replace)_\w+\("  # the kubernetes client's
    r"|\._api\.(?:post|merge_patch)\("  # the agent's RestClient
    r'|f"\{verb\}_'  # a client verb chosen at run time (create, replace, delete)
)
"""A call that sends a write to the API: the `kubernetes` package's verbs, named or chosen at
run time, and the agent's own client's POST and merge patch."""


def table_modules(text: str) -> list[str]:
    """The module column of the section "Who writes what", in order."""
    section = text.split("## Who writes what", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    return [m for row in rows for m in re.findall(r"`((?:operator|nodeagent)/[\w/]+\.py)`", row)]


def writing_modules(roots: tuple[Path, ...] = ROOTS) -> set[str]:
    """Every module under `roots` that makes a write call, as a repository path."""
    return {
        str(path.relative_to(REPO))
        for root in roots
        for path in root.rglob("*.py")
        if WRITE_CALL.search(path.read_text())
    }


def test_every_module_that_writes_is_in_the_table_and_every_named_one_exists() -> None:
    named = table_modules(DESIGN.read_text())
    assert len(named) == len(set(named)), "one row per module"
    assert [m for m in named if not (REPO / m).is_file()] == []
    assert sorted(writing_modules() - set(named)) == [], "add it to docs/design.md's table"


def test_the_check_finds_a_writer_left_out() -> None:
    """The same check, on a table that lost a row, names the module."""
    text = DESIGN.read_text()
    row = next(line for line in text.splitlines() if "writers/podmarker.py" in line)
    named = set(table_modules(text.replace(row + "\n", "")))
    assert writing_modules() - named == {"operator/gpuusage_operator/writers/podmarker.py"}
    assert WRITE_CALL.search("asyncio.create_task(x)") is None
    assert WRITE_CALL.search("self._api.merge_patch(path, body)") is not None
