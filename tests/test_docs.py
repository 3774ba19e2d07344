"""The README and docs/ say only what exists: every relative link reaches a file (and a heading,
where it names one), every command they show names a real make target, a real `gpuusage`
command with real flags, a real path to apply or install, a real script or module, and every
default they give a flag is the code's."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import pytest

from gpuusage.api.reasons import EVERY_REASON, PolicyEventReason, members
from gpuusage.cli import build_parser
from gpuusage.settings import CommandSettings, env_names, flag_name
from gpuusage_commands.crd import CrdSettings
from gpuusage_commands.ps import PsSettings
from gpuusage_commands.top import TopSettings
from gpuusage_dev.commands import BuildSettings, DemoSettings, LocalClusterSettings
from gpuusage_nodeagent.lease import LEASE_DURATION, renew_every
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_operator.judge.freshness import DEFAULT_STALE_AFTER
from gpuusage_operator.settings import OperatorSettings

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
    # the changelog is not read for names (it records what was true then), but it is there
    known = {p.name for p in sources if p.suffix == ".md"} | {"CHANGELOG.md"}
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
        if chart.startswith("oci://"):  # as a release publishes it (DESIGN), at a version
            published = re.fullmatch(r"oci://[^/\s]+(/\S+)?/charts/gpuusage(@sha256:\S+)?", chart)
            if published is None:
                return f"a release's chart is oci://REGISTRY/charts/gpuusage, not {chart}"
            pinned = published.group(2) or "--version" in words
            return None if pinned else f"{chart} without a --version or digest"
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
    assert _check("helm install gpuusage oci://ghcr.io/gpuusage/charts/gpuusage -n x") is not None
    assert _check("helm install g oci://ghcr.io/gpuusage/gpuusage --version 1.0.0") is not None
    assert _check("helm install g oci://ghcr.io/gpuusage/charts/gpuusage --version 1.0.0") is None
    assert _check(".venv/bin/python benchmarks/agent_cycle.py --no-such-flag 1") is not None
    assert _check("python -m gpuusage_dev.no_such_module") is not None
    assert _check("gpuusage top --by namespace --window 24h --prometheus http://p:9090") is None
    assert len(COMMANDS) > 40, "the documents show commands"
    assert any(c.startswith("gpuusage ") for _, c in COMMANDS)
    assert isinstance(build_parser(), argparse.ArgumentParser)


# -- the defaults the documents give flags ------------------------------------------------

SETTINGS: dict[str, type[CommandSettings]] = {
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
    for name, model in SETTINGS.items():
        if command is not None and name != command:
            continue
        for field, info in model.model_fields.items():
            if flag_name(field) == flag and not info.is_required():
                found.append(info.default)
    return found


def _same(default: Any, said: str) -> bool:
    said = said.strip().strip("`")
    if default is None:
        return said == "unset"
    if isinstance(default, bool):
        return said == ("on" if default else "off")
    if isinstance(default, tuple):  # a repeatable flag
        return said == (", ".join(default) if default else "none")
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


def flags_table(text: str, model: type[CommandSettings], prefix: str) -> list[str]:
    """Where a document's table of one command's flags (its rows of flags whose names start
    with `prefix`) misses a flag, names one the command lacks, gives a default other than the
    code's, or leaves out a variable the flag reads."""
    fields = {flag_name(f): f for f in model.model_fields if flag_name(f).startswith(prefix)}
    rows = {
        m[1]: m[0]
        for m in re.finditer(r"^\| `(--[a-z0-9-]+)` \|.*$", text, re.M)
        if m[1].startswith(prefix)
    }
    wrong = [f"{flag}: not in the table" for flag in sorted(set(fields) - set(rows))]
    wrong += [f"{flag}: no such flag" for flag in sorted(set(rows) - set(fields))]
    for flag, row in rows.items():
        if flag in fields:
            wrong += [
                f"{flag}: {env} not named"
                for env in env_names(model, fields[flag])
                if f"`{env}`" not in row
            ]
    return wrong + table_defaults("\n".join(rows.values()))


def test_the_bills_flags_are_in_its_table_with_their_defaults_and_variables() -> None:
    """docs/bill.md's table of the flags that reach a Prometheus asking who is calling is
    every one of `gpuusage top`'s --prometheus-* flags, each with its default and variable."""
    assert flags_table((ROOT / "docs" / "bill.md").read_text(), TopSettings, "--prometheus-") == []


def test_the_flags_table_check_can_fail() -> None:
    user = "| `--prometheus-user` | unset | the user (env `GPUUSAGE_PROMETHEUS_USER`) |"
    assert flags_table(user, TopSettings, "--prometheus-user") == []
    assert flags_table(user.replace("unset", "alice"), TopSettings, "--prometheus-user") == [
        "None --prometheus-user | alice: the code's default is [None]"
    ]
    assert flags_table(
        user.replace("(env `GPUUSAGE", "(env `X"), TopSettings, "--prometheus-u"
    ) == ["--prometheus-user: GPUUSAGE_PROMETHEUS_USER not named"]
    assert flags_table(user, TopSettings, "--prometheus-") == [
        f"--prometheus-{f}: not in the table"
        for f in ("ca-file", "header", "password-file", "token-file")
    ]
    assert (
        flags_table(
            user + "\n| `--prometheus-token` | unset | x |", TopSettings, "--prometheus-user"
        )
        == []
    )
    assert flags_table("| `--prometheus-token` | unset | x |", TopSettings, "--prometheus-t") == [
        "--prometheus-token-file: not in the table",
        "--prometheus-token: no such flag",
        "None --prometheus-token | unset: the code's default is []",
    ]
    header = "| `--prometheus-header` | none | x (env `GPUUSAGE_PROMETHEUS_HEADER`) |"
    assert flags_table(header, TopSettings, "--prometheus-header") == []


def test_the_default_checks_can_fail() -> None:
    assert table_defaults("| operator `--stale-after` | 180 s | x |") != []  # unset in code
    assert named_defaults("flagged after `--idle-after` (1200 s) without use") == [
        "--idle-after (1200): the code's default is [1800.0]"
    ]
    assert named_defaults("`--policy-notice` (4 minutes)") != []
    assert named_defaults("`--policy-notice` (5 minutes), `--workers` (16)") == []
    assert named_defaults("`--no-such-flag` (3)") == ["--no-such-flag: no command has it"]
    row = "| operator `--pod-writes-per-second`, `--pod-write-burst` | 50, 400 | budget |"
    assert table_defaults(row) == ["operator --pod-write-burst | 400: the code's default is [500]"]
    assert table_defaults("| agent `--idle-after` | 1800 s | x |") != []  # the operator's


# -- the agent's Lease: its default and the share of it an interval may take ------------------

CHART_DIR = ROOT / "charts" / "gpuusage"
SHARES = {"half": 2, "a third": 3, "third": 3, "a quarter": 4, "quarter": 4}
TIMES = {"twice": 2, "three times": 3, "four times": 4}
LEASE_SHARE = re.compile(
    r"(?:renewed every|renews? (?:it )?every) (half|a third|third|a quarter|quarter)\b"
    r"|(?:at most|over) (half|a third|a quarter) (?:of )?(?:the |its )?"
    r"(?:Lease(?:'s)? duration|lease duration|leaseDuration|`--lease-duration`)"
)
"""A statement of how often the agent renews its Lease, or how much of it an interval may take."""
LEASE_TIMES = re.compile(r"at least (twice|three times|four times) the interval", re.I)


def lease_claims(text: str, share: int) -> list[str]:
    """Where a text says the Lease is renewed, or an interval bounded, at another share of the
    Lease's duration than the code's (1/share)."""
    said = [(m[0], SHARES[m[1] or m[2]]) for m in LEASE_SHARE.finditer(text)]
    said += [(m[0], TIMES[m[1]]) for m in LEASE_TIMES.finditer(text)]
    return [f"{words!r}: the code's is 1/{share}" for words, n in said if n != share]


def _lease_share() -> int:
    """The share of its duration at which the agent renews its Lease, and the longest interval
    its settings accept: one number, or the code disagrees with itself."""
    duration: float = AgentSettings.model_fields["lease_duration"].default
    share = round(duration / renew_every(timedelta(seconds=duration)).total_seconds())
    bound = duration / share
    AgentSettings(node_name="n", lease_namespace="ns", lease_duration=duration, interval=bound)
    with pytest.raises(ValueError, match="--interval must be at most"):
        AgentSettings(
            node_name="n", lease_namespace="ns", lease_duration=duration, interval=bound + 0.01
        )
    return share


def test_the_lease_default_and_its_share_are_the_codes_wherever_said() -> None:
    """The chart's schema, values and template, and every document, give the agent's Lease the
    code's default, bounds and renewal share, and staleAfter unset the code's thresholds."""
    field = AgentSettings.model_fields["lease_duration"]
    duration, interval = field.default, AgentSettings.model_fields["interval"].default
    assert timedelta(seconds=duration) == LEASE_DURATION
    share = _lease_share()
    assert share == 3
    bounds = {type(m).__name__: getattr(m, type(m).__name__.lower()) for m in field.metadata}

    agent = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]["agent"]
    lease = agent["properties"]["leaseDuration"]
    assert f"null: {duration:g}." in lease["description"]
    number = next(o for o in lease["oneOf"] if o["type"] == "number")
    assert (number["minimum"], number["maximum"]) == (bounds["Ge"], bounds["Le"])
    assert f"null: {interval:g}." in agent["properties"]["interval"]["description"]
    template = (CHART_DIR / "templates" / "agent-daemonset.yaml").read_text()
    assert f"$agent.leaseDuration | default {duration:g} |" in template
    assert f"$agent.interval | default {interval:g} |" in template
    assert f"(mulf $interval {share})" in template
    values = (CHART_DIR / "values.yaml").read_text()
    assert re.search(rf"leaseDuration: null  #.*\({duration:g}\)", values)

    stale = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]["operator"]
    said = stale["properties"]["staleAfter"]["description"]
    assert f"the Lease's own duration (agent.leaseDuration, {duration:g})" in said
    assert f"{DEFAULT_STALE_AFTER.total_seconds():g} for an agent that renews no Lease" in said

    texts = {
        str(path.relative_to(ROOT)): path.read_text()
        for path in (*DOCUMENTS, CHART_DIR / "values.yaml", CHART_DIR / "values.schema.json")
        if path.parent.name != "benchmarks"  # it measures the agent as it was, too
    }
    wrong = {name: lease_claims(text, share) for name, text in texts.items()}
    assert {name: w for name, w in wrong.items() if w} == {}
    assert sum(len(LEASE_SHARE.findall(t)) for t in texts.values()) >= 6  # the texts are read
    for match in re.finditer(
        r"`--lease-duration (\d+)` \(renewed every third of it, about "
        r"([\d.]+) s\)",
        texts["docs/node-faults.md"],
    ):
        every = renew_every(timedelta(seconds=int(match[1]))).total_seconds()
        assert f"{every:.1f}" == match[2]


def test_the_lease_claim_check_can_fail() -> None:
    assert lease_claims("interval: null  # (10); at most half the leaseDuration", 3) == [
        "'at most half the leaseDuration': the code's is 1/3"
    ]
    assert lease_claims("renewed every 2.5 s", 3) == []
    assert lease_claims("the Lease, renewed every quarter: 10 s", 3) != []
    assert lease_claims("At least 10, and at least twice the interval.", 3) != []
    assert lease_claims("renewed every third of it; at least three times the interval", 3) == []


# -- the reasons the operator writes -----------------------------------------------------------

OPERATOR = ROOT / "operator" / "gpuusage_operator"


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def written_reasons(source: str) -> set[str]:
    """The condition and Event reasons a module writes as literals: an Event's (PodEvent's
    first argument), a pod condition's (`_gpu_in_use`'s second), a `reason=` argument, a
    value given to a name `reason` or `REASON_*` (a mapping's values too). Reasons made up
    from an outcome (`f"GPUPolicy{outcome}"`) are not read."""
    found: set[str] = set()

    def values(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value  # {...}.get(outcome, ...)
        if isinstance(node, ast.Dict):
            return [v for v in map(_literal, node.values) if v]
        text = _literal(node)
        return [text] if text else []

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            at = {"PodEvent": 0, "_gpu_in_use": 1}.get(name)
            if at is not None and len(node.args) > at:
                found.update(values(node.args[at]))
            found.update(v for kw in node.keywords if kw.arg == "reason" for v in values(kw.value))
        targets: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    targets += zip(target.elts, node.value.elts, strict=False)
                else:
                    targets.append((target, node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets.append((node.target, node.value))
        for named, value in targets:
            if isinstance(named, ast.Name) and (
                named.id == "reason" or named.id.startswith("REASON_")
            ):
                found.update(values(value))
    return found


def test_every_reason_is_in_the_docs() -> None:
    """Every reason of gpuusage.api.reasons (the one list the code's types hold it to) is
    named in the README or docs/."""
    assert len(EVERY_REASON) >= 35, EVERY_REASON  # the module is read
    text = "\n".join(d.read_text() for d in DOCUMENTS)
    assert [r for r in EVERY_REASON if f"`{r}`" not in text and f"{r}:" not in text] == []


def test_every_reason_the_operator_writes_is_one_of_the_list() -> None:
    """What the code writes as a literal is one of gpuusage.api.reasons' (the types check the
    rest): a reason made up anywhere else fails here."""
    written = set()
    for path in sorted(OPERATOR.rglob("*.py")):
        written |= written_reasons(path.read_text())
    assert len(written) >= 25, sorted(written)  # the code is read
    assert sorted(written - set(EVERY_REASON)) == []
    assert "GPUPolicyRateLimited" in members(PolicyEventReason)
    assert members(Literal["a"], Literal["b", "a"]) == ("a", "b"), "once each"


def test_the_reason_check_reads_what_the_code_writes() -> None:
    source = """
REASON_X: Final = "Alpha"
event = PodEvent("Beta", "note")
condition = _gpu_in_use("True", "Gamma", "message")
reason, status = "Delta", "True"
reason = {"Done": "Epsilon"}.get(outcome, f"GPUPolicy{outcome}")
made = Cause(reason="Zeta")
"""
    assert written_reasons(source) == {"Alpha", "Beta", "Gamma", "Delta", "Epsilon", "Zeta"}
