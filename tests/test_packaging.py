"""What people install and what the images carry, each built the way it really is.

A non-editable install in a fresh virtualenv imports every module of every source root, each
under one name; each image's recipe (its Dockerfile's requirements and COPY lines) is rebuilt in
a virtualenv, runs its command, and holds no other part.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
    "find"
]["where"]
PARTS = ("gpuusage_nodeagent", "gpuusage_operator", "gpuusage_commands", "gpuusage_dev")

pytestmark = pytest.mark.slow

IMPORT_ALL = r"""
import importlib, json, sys
mods = {}
for name in sys.argv[1:]:
    mods[name] = str(importlib.import_module(name).__file__)
import gpuusage
print(json.dumps({"version": gpuusage.__version__, "modules": mods}))
"""


def source_modules() -> set[str]:
    """Every module under the source roots, named as the interpreter imports it."""
    found = set()
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found.add(".".join(parts))
    found.discard("gpuusage.__main__")
    return found


def test_each_module_has_one_name_and_no_link_exists() -> None:
    links = [p for p in REPO.rglob("*") if p.is_symlink() and ".venv" not in p.parts]
    assert not links
    assert {name.partition(".")[0] for name in source_modules()} == {"gpuusage", *PARTS}
    for root in ROOTS:
        assert len(list((REPO / root).glob("*/__init__.py"))) == 1, root


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        cwd=wheels,
    )
    return next(wheels.glob("gpuusage-*.whl"))


APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
"""Of the Apache License 2.0's text as the ASF publishes it (its LICENSE-2.0.txt)."""


def test_the_license_is_the_one_declared_and_the_wheel_carries_it(wheel: Path) -> None:
    """pyproject.toml says Apache-2.0; LICENSE is that licence's text, and the wheel carries it
    (its metadata names it)."""
    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()
    with zipfile.ZipFile(wheel) as packed:
        names = packed.namelist()
        (carried,) = [n for n in names if n.endswith("/LICENSE")]
        assert packed.read(carried) == text
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-File: LICENSE" in packed.read(metadata).decode()


def test_wheel_in_a_fresh_virtualenv_imports_every_module(tmp_path: Path, wheel: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-compile", str(wheel)], check=True, cwd=tmp_path
    )
    wanted = sorted(source_modules())
    out = subprocess.run(
        [python, "-c", IMPORT_ALL, *wanted],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    report = json.loads(out)
    from gpuusage import __version__  # noqa: PLC0415

    assert report["version"] == __version__
    for name, path in report["modules"].items():
        assert path.startswith(str(env_dir)), f"{name} imported from {path}"
    gpuusage = env_dir / "bin" / "gpuusage"
    console = subprocess.run([gpuusage, "--version"], capture_output=True, text=True, check=True)
    assert console.stdout == f"gpuusage {__version__}\n"
    for command in (["demo"], ["local-cluster", "restart"], ["top"], ["operator"]):
        shown = subprocess.run(
            [gpuusage, *command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert "--log-level" in shown


def _image(tmp_path: Path, part: str) -> tuple[Path, dict[str, str]]:
    """The image's recipe in a virtualenv: its requirements installed, its COPY lines copied."""
    recipe = (REPO / part / "Dockerfile").read_text()
    requirements = re.findall(r"^COPY (\S+requirements\.lock) ", recipe, re.MULTILINE)
    copied = re.findall(r"^COPY (?!--)(\S+) /app/(\S+)$", recipe, re.MULTILINE)
    assert requirements
    assert copied
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    args = [arg for file in requirements for arg in ("-r", str(REPO / file))]
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--require-hashes", "--no-deps", *args],
        check=True,
        cwd=tmp_path,
    )
    app = tmp_path / "app"
    for source, target in copied:
        shutil.copytree(REPO / source, app / target)
    env = {**os.environ, "PYTHONPATH": str(app), "PYTHONDONTWRITEBYTECODE": "1"}
    return python, env


def _absent(python: Path, env: dict[str, str], module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], env=env, check=False).returncode == 1


def test_agent_image_recipe_runs_the_agent_and_holds_nothing_else(tmp_path: Path) -> None:
    python, env = _image(tmp_path, "nodeagent")
    for module in ("kubernetes", "kopf", *[p for p in PARTS if p != "gpuusage_nodeagent"]):
        assert _absent(python, env, module), module
    proc = tmp_path / "proc"
    uid, cid = "11111111-2222-4333-8444-555555555555", "ab" * 32
    cgroup = (
        f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n"
    )
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(cgroup)
    (proc / "4242" / "comm").write_text("python3\n")
    (proc / "4242" / "stat").write_text("4242 (python3) S" + " 0" * 18 + " 777 0 0\n")
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "gpus:\n  - index: 0\n    uuid: GPU-11111111-2222-3333-4444-555555555555\n"
        "    memoryTotalMiB: 81920\n    processes:\n      - pid: 4242\n"
        "        usedMemoryMiB: 1024\n"
    )
    out = subprocess.run(
        [
            python,
            "-m",
            "gpuusage",
            "agent",
            "--once",
            "--output",
            "json",
            "--node-name",
            "gpu-1",
            "--gpu-source",
            f"fake:{scenario}",
            "--proc-root",
            str(proc),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    ).stdout
    spec = json.loads(out)["spec"]
    process = spec["gpus"][0]["processes"][0]
    assert (process["podUID"], process["containerID"]) == (uid, cid)
    from gpuusage import __version__  # noqa: PLC0415

    assert spec["source"]["agentVersion"] == __version__
    demo = subprocess.run(
        [python, "-m", "gpuusage", "demo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert demo.returncode == 1
    assert "`gpuusage demo` is not in this installation (its part gpuusage_dev" in demo.stderr


def test_operator_image_recipe_holds_the_operator_and_nothing_else(tmp_path: Path) -> None:
    python, env = _image(tmp_path, "operator")
    for module in ("pynvml", *[p for p in PARTS if p != "gpuusage_operator"]):
        assert _absent(python, env, module), module
    imported = subprocess.run(
        [python, "-c", "import gpuusage_operator.main, gpuusage_operator.handlers"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    shown = subprocess.run(
        [python, "-m", "gpuusage", "operator", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "--stale-after" in shown or "--kubeconfig" in shown
