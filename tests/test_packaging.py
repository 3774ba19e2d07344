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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        cwd=wheels,
    )
    return next(wheels.glob("gpuusage-*.whl"))


def test_wheel_in_a_fresh_virtualenv_imports_every_module(tmp_path: Path, wheel: Path) -> None:
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


def test_agent_image_recipe_runs_the_agent_without_kubernetes_or_kopf(
    tmp_path: Path, wheel: Path
) -> None:
    """What nodeagent/Dockerfile installs (the wheel without dependencies, plus
    nodeagent/requirements.txt) is enough for the agent, and holds no operator packages."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    requirements = REPO / "nodeagent" / "requirements.txt"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", str(wheel)],
                   check=True, cwd=tmp_path)  # fmt: skip
    subprocess.run([python, "-m", "pip", "install", "-q", "-r", str(requirements)],
                   check=True, cwd=tmp_path)  # fmt: skip
    absent = subprocess.run([python, "-c", "import kubernetes"], capture_output=True, check=False)
    assert absent.returncode != 0
    absent = subprocess.run([python, "-c", "import kopf"], capture_output=True, check=False)
    assert absent.returncode != 0
    proc = tmp_path / "proc"
    uid, cid = "11111111-2222-4333-8444-555555555555", "ab" * 32
    cgroup = (f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/"
              f"cri-containerd-{cid}.scope\n")  # fmt: skip
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
        [env_dir / "bin" / "gpuusage", "agent", "--once", "--output", "json", "--node-name",
         "gpu-1", "--gpu-source", f"fake:{scenario}", "--proc-root", str(proc)],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    process = json.loads(out)["spec"]["gpus"][0]["processes"][0]
    assert (process["podUID"], process["containerID"]) == (uid, cid)
