"""The README and docs/ say only what exists: every relative link reaches a file (and a heading,
where it names one), and every command they show names a real make target, a real `gpuusage`
command with real flags, a real path to apply or install, a real script or module."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpuusage.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "benchmarks" / "README.md",
        ROOT / "charts" / "gpuusage" / "README.md",
    ]
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`((?:make|gpuusage|kubectl gpuusage|kubectl apply -k) [^`]+)`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(document: Path) -> set[str]:
    text = FENCE.sub("", document.read_text())
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(document: Path) -> list[str]:
    text = FENCE.sub("", document.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [m[1] for m in LINK.finditer(text)]


def _broken_links(document: Path) -> list[str]:
    broken = []
    for target in _links(document):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        found = (document.parent / path).resolve() if path else document
        if not found.exists():
            broken.append(f"{target}: no such file")
        elif anchor and found.suffix == ".md" and anchor not in _anchors(found):
            broken.append(f"{target}: no heading #{anchor} in {found.name}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_its_file_and_heading(document: Path) -> None:
    assert document.exists()
    assert not _broken_links(document)


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Who holds it: `gpuusage top`\n## Operator: 5 / 6 pods\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#who-holds-it-gpuusage-top) [b](other.md#operator-5--6-pods) "
        "[c](missing.md) [d](other.md#nowhere) `[e](missing.md)` [f](https://x.org/y)\n"
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in other.md",
    ]


def test_the_readme_is_a_guide_with_docs_beside_it() -> None:
    """The order a user needs: install, what you see, policies, configuration,
    troubleshooting, then how to try it without a cluster; at most README_MOST_LINES lines,
    the design, the details and the evidence in docs/, every page of it linked."""
    text = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", FENCE.sub("", text), re.M)
    wanted = [
        "Install",
        "What you see",
        "Policies",
        "Configuration",
        "Troubleshooting",
        "Try it without a cluster",
    ]
    positions = [next(i for i, h in enumerate(headings) if h.startswith(w)) for w in wanted]
    assert positions == sorted(positions), headings
    assert len(text.splitlines()) <= README_MOST_LINES
    linked = {Path(t.partition("#")[0]).name for t in _links(ROOT / "README.md")}
    for doc in (ROOT / "docs").glob("*.md"):
        assert doc.name in linked, f"docs/{doc.name} is not linked from the README"


README_MOST_LINES = 350
SKIPPED = {".git", ".venv", "build", "node_modules", ".whl"}
DOCUMENT_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.md)(?!\w)")


def _sources() -> list[Path]:
    """The repository's own text: every Python module and Markdown page but the changelog
    (which records what was true then); the virtualenv, builds and caches are not walked."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED and not d.endswith(".egg-info")]
        found += [
            Path(folder) / f for f in files if f.endswith((".py", ".md")) and f != "CHANGELOG.md"
        ]
    return sorted(found)


def missing_documents(path: Path, known: set[str]) -> list[str]:
    """The Markdown files `path` names that the repository does not have: a name with a folder
    is looked up from the file's folder and from the root; a bare name anywhere."""
    missing = []
    for name in DOCUMENT_NAME.findall(path.read_text(errors="replace")):
        if "/" in name:
            found = (path.parent / name).exists() or (ROOT / name).exists()
        else:
            found = name in known
        if not found:
            missing.append(name)
    return missing


def test_no_file_names_a_document_the_repository_lacks() -> None:
    sources = _sources()
    known = {p.name for p in sources if p.suffix == ".md"}
    named = {str(p.relative_to(ROOT)): missing_documents(p, known) for p in sources}
    assert {k: v for k, v in named.items() if v and k != "tests/test_docs.py"} == {}


def test_the_document_name_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.py"
    page.write_text('"""As DESIGN.md says; see docs/gone.md, docs/api.md, https://x.org/y.md."""')
    assert missing_documents(page, {"api.md"}) == ["DESIGN.md", "docs/gone.md"]


def _commands() -> list[tuple[str, str]]:
    """(document, command) for every command line in a shell block, and every command in a
    code span that starts like one; continuation lines joined, comments and `[optional]`
    parts dropped."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        name = str(document.relative_to(ROOT))
        for lang, block in FENCE.findall(text):
            if lang not in ("sh", "bash", "shell"):
                continue
            for raw in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", raw).strip()
                if line:
                    found.append((name, line))
        prose = FENCE.sub("", text).replace("\n", " ")
        found += [(name, m[1]) for m in INLINE.finditer(prose)]
    return [(d, re.sub(r"\s*\[[^\]]*\]", "", c)) for d, c in found]


COMMANDS = _commands()
TARGETS = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check_gpuusage(words: list[str]) -> str | None:
    parser = build_parser()
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(words)
        except SystemExit as exc:
            if exc.code not in (0, None):
                return errors.getvalue().strip().splitlines()[-1]
    return None


def _check_paths(words: list[str], flags: tuple[str, ...]) -> str | None:
    for i, word in enumerate(words[:-1]):
        if word in flags:
            path = words[i + 1]
            if "://" not in path and not (ROOT / path).exists():
                return f"no such path: {path}"
    return None


def _check(command: str) -> str | None:
    """What is wrong with one command, or None."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        return f"cannot be split as the shell would: {exc}"
    if words[:1] == ["make"]:
        missing = [w for w in words[1:] if "=" not in w and w not in TARGETS]
        return f"no make target {missing}" if missing else None
    if words[:1] == ["gpuusage"]:
        return _check_gpuusage(words[1:])
    if words[:2] == ["kubectl", "gpuusage"]:
        return _check_gpuusage(words[2:])
    if words[:1] == ["kubectl"]:
        return _check_paths(words, ("-k", "-f"))
    if words[:1] == ["helm"] and len(words) > 3 and words[1] in ("install", "upgrade"):
        chart = words[3]
        return None if (ROOT / chart).exists() else f"no chart at {chart}"
    if words[:1] == ["docker"]:
        return _check_paths(words, ("-f",))
    python = next((i for i, w in enumerate(words) if w.endswith(("python", "python3"))), None)
    if python is not None and len(words) > python + 1:
        args = words[python + 1 :]
        if args[0] == "-m":
            module = args[1]
            return None if importlib.util.find_spec(module) else f"no module {module}"
        script = ROOT / args[0]
        if not script.exists():
            return f"no script {args[0]}"
        flags = [w.split("=")[0] for w in args[1:] if w.startswith("--")]
        if flags:
            shown = subprocess.run(
                [sys.executable, str(script), "--help"],
                capture_output=True,
                text=True,
                check=False,
                cwd=ROOT,
            ).stdout
            unknown = [f for f in flags if f not in shown]
            return f"{args[0]} has no {unknown}" if unknown else None
    return None


@pytest.mark.slow  # each runs a command
@pytest.mark.parametrize(("document", "command"), COMMANDS, ids=[f"{d}: {c}" for d, c in COMMANDS])
def test_every_command_shown_exists(document: str, command: str) -> None:
    problem = _check(command)
    assert problem is None, f"{document}: `{command}`: {problem}"


def test_the_command_check_can_fail() -> None:
    """The checks above refuse what does not exist."""
    assert _check("make no-such-target") is not None
    assert _check("gpuusage top --no-such-flag") is not None
    assert _check("gpuusage no-such-command") is not None
    assert _check("kubectl apply -k manifests/overlays/no-such") is not None
    assert _check("helm install gpuusage charts/none -n x") is not None
    assert _check(".venv/bin/python benchmarks/agent_cycle.py --no-such-flag 1") is not None
    assert _check("python -m gpuusage_dev.no_such_module") is not None
    assert _check("gpuusage top --by namespace --window 24h --prometheus http://p:9090") is None
    assert len(COMMANDS) > 40, "the documents show commands"
    assert any(c.startswith("gpuusage ") for _, c in COMMANDS)
    assert isinstance(build_parser(), argparse.ArgumentParser)
