"""The hosted workflows (.github/workflows) checked by actionlint, built once from its Go module.

GitHub reads a workflow only when an event runs it: a wrong expression, permission, runner
label or action input would show on the first push, or for the release on the first tag.
`make lint` runs actionlint on every workflow, and `tests/test_workflows.py` also holds what
they run. actionlint checks the `run:` scripts with shellcheck where it is on PATH (it is on
GitHub's Ubuntu runners; elsewhere `apt-get install shellcheck`), and says so where it is not.

    python -m gpuusage_dev.workflows [FILE ...]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from gpuusage_dev.localcluster.tools import ACTIONLINT, ensure_tool

REPO = Path(__file__).resolve().parents[2]
FOLDER = Path(".github/workflows")


def workflow_files(repo: Path = REPO) -> list[Path]:
    """Every workflow of the repository, relative to it."""
    found = [*(repo / FOLDER).glob("*.yml"), *(repo / FOLDER).glob("*.yaml")]
    return sorted(p.relative_to(repo) for p in found)


def actionlint(files: list[Path], repo: Path = REPO) -> subprocess.CompletedProcess[str]:
    """actionlint's verdict on `files` (its output names each problem by file and line).
    Python scripts are not checked (no workflow runs one inline)."""
    shellcheck = shutil.which("shellcheck") or ""
    return subprocess.run(
        [
            str(ensure_tool(ACTIONLINT)),
            *("-no-color", f"-shellcheck={shellcheck}", "-pyflakes="),
            *map(str, files),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or workflow_files()
    if not files:
        print(f"no workflows in {FOLDER}", file=sys.stderr)
        return 1
    if shutil.which("shellcheck") is None:
        print(
            "note: shellcheck not found, so the workflows' run: scripts are not checked "
            "(apt-get install shellcheck)",
            file=sys.stderr,
        )
    verdict = actionlint(files)
    sys.stdout.write(verdict.stdout)
    sys.stderr.write(verdict.stderr)
    if verdict.returncode == 0:
        print(f"actionlint {ACTIONLINT.version}: {', '.join(map(str, files))} fine")
    return verdict.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
