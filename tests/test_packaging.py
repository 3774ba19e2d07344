"""A non-editable install in a fresh virtualenv imports every module.

This is what proves the folder mapping (operator/ -> gpuusage.operator, nodeagent/ ->
gpuusage.nodeagent) works for users, not only through the source tree's symbolic links.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# Walks files, not pkgutil: gpuusage.operator is a namespace subpackage (see operator/README.md),
# which pkgutil.walk_packages does not descend into.
IMPORT_ALL = r"""
import importlib, json, pathlib
import gpuusage
root = pathlib.Path(gpuusage.__file__).parent
mods = {}
for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).with_suffix("")
    if rel.name == "__main__":
        continue
    name = ".".join(["gpuusage", *[p for p in rel.parts if p != "__init__"]])
    mods[name] = str(importlib.import_module(name).__file__ or path.parent)
print(json.dumps({"root": gpuusage.__file__, "version": gpuusage.__version__, "modules": mods}))
"""


def _source_modules() -> set[str]:
    found = set()
    for base, package in ((REPO / "src" / "gpuusage", "gpuusage"),
                          (REPO / "operator", "gpuusage.operator"),
                          (REPO / "nodeagent", "gpuusage.nodeagent")):  # fmt: skip
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            if any(part in ("operator", "nodeagent") for part in rel.parts[:1]) and (
                package == "gpuusage"
            ):
                continue  # reached through the symbolic links; counted under their own name
            parts = [p for p in rel.parts if p != "__init__"]
            found.add(".".join([package, *parts]))
    found.discard("gpuusage.__main__")
    return found


def test_wheel_in_a_fresh_virtualenv_imports_every_module(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        cwd=tmp_path,
    )
    wheel = next(wheels.glob("gpuusage-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-compile", str(wheel)], check=True, cwd=tmp_path
    )
    out = subprocess.run(
        [python, "-c", IMPORT_ALL], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout
    report = json.loads(out)
    assert report["root"].startswith(str(env_dir)), "gpuusage must come from the fresh venv"
    assert report["version"] != "0.0.0+source"
    imported = set(report["modules"])
    missing = _source_modules() - imported - {"gpuusage"}
    assert not missing, f"modules not installed: {sorted(missing)}"
    assert any(name.startswith("gpuusage.operator.") for name in imported)
    assert any(name.startswith("gpuusage.nodeagent") for name in imported)
    for name, path in report["modules"].items():
        assert path.startswith(str(env_dir)), f"{name} imported from {path}"
    console = subprocess.run(
        [env_dir / "bin" / "gpuusage", "--version"], capture_output=True, text=True, check=True
    )
    assert console.stdout.startswith("gpuusage ")
