"""The code's layout as the docs describe it: no import circle between a package's modules.

A circle means two modules that cannot be read, tested or moved apart; each package is meant
to read in one pass from its edges to its pure core. Imports under TYPE_CHECKING count too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "gpuusage": REPO / "src" / "gpuusage",
    "gpuusage_operator": REPO / "operator" / "gpuusage_operator",
    "gpuusage_nodeagent": REPO / "nodeagent" / "gpuusage_nodeagent",
    "gpuusage_commands": REPO / "commands" / "gpuusage_commands",
    "gpuusage_dev": REPO / "devtools" / "gpuusage_dev",
}

Graph = dict[str, set[str]]


def modules(package: str, folder: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module of the package (a package is its
    __init__)."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def _imported(tree: ast.AST, here: str, is_package: bool) -> Iterator[str]:
    """Every dotted name an import statement of the module names (for `from a import b`: both
    `a` and `a.b`, since `b` may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(package: str, folder: Path) -> Graph:
    """Module → the package's modules it imports (not itself, not its own parent packages,
    which Python imports on the way in any case)."""
    known = modules(package, folder)
    graph: Graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for imported in _imported(tree, name, path.name == "__init__.py"):
            if imported in known and imported != name and not name.startswith(f"{imported}."):
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found() -> None:
    """The check can fail: a circle of three, and one through a package's __init__."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert circles(graph) == [["p.a", "p.b", "p.c"]]
    assert circles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_the_graph_reads_every_form_of_import(tmp_path: Path) -> None:
    room = tmp_path / "pkg" / "room"
    room.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (room / "__init__.py").write_text("from pkg.room import one\n")
    (room / "one.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.room.two import X\n"
    )
    (room / "two.py").write_text("from . import one\nimport pkg.top\n")
    (tmp_path / "pkg" / "top.py").write_text("from pkg.room import two\n")
    graph = import_graph("pkg", tmp_path / "pkg")
    assert graph == {
        "pkg": set(),
        "pkg.room": {"pkg.room.one"},
        "pkg.room.one": {"pkg.room.two"},
        "pkg.room.two": {"pkg.room.one", "pkg.top"},
        "pkg.top": {"pkg.room", "pkg.room.two"},
    }
    assert circles(graph) == [["pkg.room", "pkg.room.one", "pkg.room.two", "pkg.top"]]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package: str) -> None:
    assert circles(import_graph(package, PACKAGES[package])) == []


DEVELOPMENT = REPO / "docs" / "development.md"
ROOTS = {name: folder.parent.name + "/" for name, folder in PACKAGES.items()}


def entries(package: str, folder: Path) -> set[tuple[str, ...]]:
    """What a package holds, as development.md lists it: (module,) and (subpackage/,) for a
    package; (room/, module) and ((top), module) for the operator, whose subpackages are
    rooms."""
    found: set[tuple[str, ...]] = set()
    rooms = package == "gpuusage_operator"
    for path in folder.glob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            found.add(("(top)", path.stem) if rooms else (path.stem,))
    for sub in folder.iterdir():
        if (sub / "__init__.py").exists():
            if rooms:
                found |= {
                    (f"{sub.name}/", p.stem) for p in sub.glob("*.py") if p.stem != "__init__"
                }
            else:
                found.add((f"{sub.name}/",))
    return found


def listed(text: str, package: str) -> set[tuple[str, ...]]:
    """The rows of the package's table in development.md: its first cells, backticks dropped
    (two cells for the operator's room and module)."""
    heading = f"### `{package}` ({ROOTS[package]})"
    assert heading in text, f"development.md has no section {heading}"
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    cells = 2 if package == "gpuusage_operator" else 1
    rows = set()
    for line in section.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if (
            not line.startswith("|")
            or set(parts[0]) <= {"-", " "}
            or parts[0] in ("module", "room")
        ):
            continue
        rows.add(tuple(p.strip("`") for p in parts[:cells]))
    return rows


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_development_lists_every_module_and_nothing_else(package: str) -> None:
    """docs/development.md's table of each package is the package: a module added, moved or
    removed without its row fails here."""
    shown = listed(DEVELOPMENT.read_text(), package)
    real = entries(package, PACKAGES[package])
    assert sorted(real - shown) == [], "in the code, not in docs/development.md"
    assert sorted(shown - real) == [], "in docs/development.md, not in the code"


def test_the_layout_check_can_fail(tmp_path: Path) -> None:
    room = tmp_path / "gpuusage_operator" / "judge"
    room.mkdir(parents=True)
    for path in (room.parent / "__init__.py", room / "__init__.py", room / "report.py"):
        path.write_text("")
    (room.parent / "main.py").write_text("")
    assert entries("gpuusage_operator", room.parent) == {("(top)", "main"), ("judge/", "report")}
    text = (
        "### `gpuusage_operator` (operator/)\n\n| room | module | what |\n| --- | --- | --- |\n"
        "| (top) | `main` | x |\n| `judge/` | `gone` | y |\n\n"
        "## Next\n| `judge/` | `report` | z |\n"
    )
    assert listed(text, "gpuusage_operator") == {("(top)", "main"), ("judge/", "gone")}


TEST_IMPORT = re.compile(r"^[ \t]*(?:from|import)[ \t]+tests\.test_\w+", re.M)


def test_imports_of_test_modules(tmp_path: Path) -> None:
    """Tests build their world from tests/builders.py, tests/nodeworld.py and the fixtures of
    conftest, never from another test module (whose helpers then change under its tests)."""
    found = {
        str(path.relative_to(REPO)): TEST_IMPORT.findall(path.read_text())
        for path in sorted((REPO / "tests").rglob("*.py"))
    }
    assert {name: lines for name, lines in found.items() if lines} == {}
    planted = tmp_path / "test_x.py"
    planted.write_text('"""x"""\n\nfrom tests.test_top import _pod\n')
    assert TEST_IMPORT.findall(planted.read_text()) == ["from tests.test_top"]


def public_names(folder: Path) -> dict[str, list[str]]:
    """Each public top-level name of the package's modules (classes, functions, constants; the
    module logger `log` aside), with the modules that define it; and each public method named
    `decide` (a name that says nothing of what is decided), under `<module>:<class>.decide`."""
    found: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        module = str(path.relative_to(folder))
        for node in ast.parse(path.read_text()).body:
            targets: list[str] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                targets = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                targets = [node.target.id]
            for name in targets:
                if not name.startswith("_") and name != "log":
                    found.setdefault(name, []).append(module)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "decide":
                        found.setdefault("decide", []).append(f"{module}:{node.name}")
    return found


def test_no_two_public_things_of_the_operator_share_a_name(tmp_path: Path) -> None:
    """A name says which thing it is: one `Decision`, one `RETRY`, no bare `decide`."""
    names = public_names(PACKAGES["gpuusage_operator"])
    assert {n: where for n, where in names.items() if len(where) > 1 or n == "decide"} == {}
    (tmp_path / "a.py").write_text("RETRY = 1\nclass Book:\n    def decide(self): ...\n")
    (tmp_path / "b.py").write_text("RETRY = 2\nlog = 3\n")
    assert public_names(tmp_path) == {
        "RETRY": ["a.py", "b.py"],
        "Book": ["a.py"],
        "decide": ["a.py:Book"],
    }


ROOM_RANKS = {
    "index": 0,
    "judge": 0,
    "writers": 1,
    "informers": 2,
    "policies": 2,
    "openreports": 3,
    "controller": 3,
    "ha": 3,
}
"""The operator's rooms from the bottom up: what pods and reports are and what they mean
(index, judge: pure) below what writes them (writers), what watches and acts on judgements
(informers, policies) and what drives it all (controller, openreports, ha). A room reads only
rooms at or below its own rank; the bottom rooms read no module outside the rooms either."""


def upward_imports(graph: Graph, package: str) -> list[str]:
    """`importer -> imported` for each import of a room by a room ranked below it, and of a
    module outside the rooms by the bottom rooms."""

    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 else None  # package.room.module

    found = []
    for importer, targets in sorted(graph.items()):
        here = room(importer)
        if here is None:
            continue
        for target in sorted(targets):
            there = room(target)
            if there is None and target != package:
                if ROOM_RANKS[here] == 0:
                    found.append(f"{importer} -> {target}")
            elif there is not None and ROOM_RANKS[there] > ROOM_RANKS[here]:
                found.append(f"{importer} -> {target}")
    return found


def test_no_room_of_the_operator_reads_a_room_above_it() -> None:
    """A newcomer reads the judge without the writers, the policies or the controller: what
    decides never calls back into what acts on the decision."""
    package, folder = "gpuusage_operator", PACKAGES["gpuusage_operator"]
    rooms = {sub.name for sub in folder.iterdir() if (sub / "__init__.py").exists()}
    assert rooms == set(ROOM_RANKS), "every room has its rank"
    assert upward_imports(import_graph(package, folder), package) == []
    planted = {
        "p.judge.podstate": {"p.writers.pods", "p.index.pods"},
        "p.index.pods": {"p.main"},
        "p.writers.pods": {"p.judge.podstate", "p.main"},
    }
    assert upward_imports(planted, "p") == [
        "p.index.pods -> p.main",
        "p.judge.podstate -> p.writers.pods",
    ]
