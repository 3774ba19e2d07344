"""Images written by hand as OCI image layouts, as containerd imports them: every blob is where
its digest says, the index names the image, the layer holds the files with their modes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from gpuusage_dev.deviceplugin import scenario_resources
from gpuusage_dev.localcluster.containerd import Containerd
from gpuusage_dev.localcluster.images import (
    OCI_LAYER,
    Platform,
    busybox_image,
    image_manifest,
    index_archive,
    oci_archive,
    pause_image,
)
from gpuusage_dev.localcluster.platforms import HOST
from gpuusage_dev.localcluster.productimages import (
    ImageBuildError,
    product_image,
    product_images,
    prune,
    recipe_of,
)
from tests.fakenvml import gpu_uuid, mig_uuid

FAKE_BUSYBOX = b"\x7fELF" + b"\0" * 60  # any bytes: only the layout is checked here


def _members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {m.name: m for m in archive.getmembers()}


def _read(data: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        found = archive.extractfile(name)
        assert found is not None
        return found.read()


def _blob(data: bytes, digest: str) -> bytes:
    blob = _read(data, "blobs/sha256/" + digest.removeprefix("sha256:"))
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == digest, "content-addressed"
    return blob


def test_an_image_archive_is_a_complete_content_addressed_oci_layout() -> None:
    archive = oci_archive(busybox_image(FAKE_BUSYBOX))
    assert json.loads(_read(archive, "oci-layout")) == {"imageLayoutVersion": "1.0.0"}
    (described,) = json.loads(_read(archive, "index.json"))["manifests"]
    assert described["annotations"]["io.containerd.image.name"] == "gpuusage.local/busybox:1"
    manifest_bytes = _blob(archive, described["digest"])
    assert len(manifest_bytes) == described["size"]
    manifest = json.loads(manifest_bytes)
    config = json.loads(_blob(archive, manifest["config"]["digest"]))
    (layer_ref,) = manifest["layers"]
    assert layer_ref["mediaType"] == OCI_LAYER
    layer = _blob(archive, layer_ref["digest"])
    assert config["rootfs"]["diff_ids"] == [layer_ref["digest"]], "an uncompressed layer"
    assert config["config"]["Cmd"] == ["/bin/sh"]
    files = _members(layer)
    assert files["bin/busybox"].mode == 0o755
    assert _read(layer, "bin/busybox") == FAKE_BUSYBOX
    assert files["bin/sh"].issym()
    assert files["bin/sh"].linkname == "busybox"
    assert files["bin"].isdir()


def test_the_same_inputs_give_the_same_image_and_the_pause_image_sleeps() -> None:
    assert oci_archive(busybox_image(FAKE_BUSYBOX)) == oci_archive(busybox_image(FAKE_BUSYBOX))
    assert oci_archive(busybox_image(FAKE_BUSYBOX)) != oci_archive(busybox_image(b"other"))
    archive = oci_archive(pause_image(FAKE_BUSYBOX))
    (described,) = json.loads(_read(archive, "index.json"))["manifests"]
    manifest = json.loads(_blob(archive, described["digest"]))
    config = json.loads(_blob(archive, manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/bin/sleep", "infinity"]
    assert described["annotations"]["org.opencontainers.image.ref.name"] == "gpuusage.local/pause:1"


@pytest.mark.slow
@pytest.mark.node
def test_real_containerd_imports_and_runs_the_images(containerd: Containerd) -> None:
    """Debian's containerd takes both archives under their names, and runc runs busybox."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox not found (apt-get install busybox-static)")
    payload = Path(busybox).read_bytes()
    containerd.import_image(oci_archive(busybox_image(payload)))
    containerd.import_image(oci_archive(pause_image(payload)))
    assert sorted(containerd.images()) == ["gpuusage.local/busybox:1", "gpuusage.local/pause:1"]
    ran = containerd.run_to_end(
        "gpuusage.local/busybox:1", "probe", "/bin/sh", "-c", "echo ok; id -u"
    )
    assert ran.returncode == 0, ran.stderr.decode()[-800:]
    assert ran.stdout.decode().split() == ["ok", "0"]
    failed = containerd.run_to_end("gpuusage.local/busybox:1", "probe", "/bin/sh", "-c", "exit 3")
    assert failed.returncode == 3, "the command's own exit status"


def test_the_device_plugin_advertises_a_scenarios_gpus_and_mig_devices() -> None:
    """Whole GPUs as nvidia.com/gpu, MIG devices under their profile (NVIDIA's mixed strategy);
    the device IDs are the UUIDs the agent reads, so PodResources and NVML agree."""
    gpus = {
        "gpus": [
            {"index": 0, "uuid": gpu_uuid(0)},
            {"index": 1, "uuid": gpu_uuid(1)},
            {
                "index": 2,
                "uuid": gpu_uuid(2),
                "migDevices": [
                    {"index": 0, "uuid": mig_uuid(0), "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb"},
                    {"index": 1, "uuid": mig_uuid(1), "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb"},
                    {"index": 2, "uuid": mig_uuid(2)},
                ],
            },
        ]
    }
    assert scenario_resources(gpus) == {
        "nvidia.com/gpu": [gpu_uuid(0), gpu_uuid(1)],
        "nvidia.com/mig-3g.40gb": [mig_uuid(0)],
        "nvidia.com/mig-1g.10gb": [mig_uuid(1)],
    }


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dockerfile", ["nodeagent/Dockerfile", "operator/Dockerfile"])
def test_the_recipe_is_read_from_the_dockerfile(dockerfile: str) -> None:
    """What the image holds comes from the Dockerfile's own lines: they cannot drift."""
    recipe = recipe_of((REPO / dockerfile).read_text())
    part = dockerfile.split("/", maxsplit=1)[0]
    assert recipe.requirements == (f"{part}/requirements.lock",)
    assert [dest for _, dest in recipe.copies] == [
        "/app/gpuusage",
        f"/app/gpuusage_{part}",
        "/licenses/LICENSE",
    ]
    assert recipe.user == "65532:65532"
    assert recipe.entrypoint == ("python", "-m", "gpuusage")
    assert recipe.cmd == ({"nodeagent": "agent"}.get(part, part),)
    assert "PYTHONPATH=/app" in recipe.env
    assert recipe.labels["org.opencontainers.image.version"] == "${VERSION}"
    assert recipe.args["REVISION"] == "unknown"
    assert recipe.bytecode == "checked-hash"


def test_a_timestamped_compile_is_refused() -> None:
    """Timestamped bytecode would make each build's bytes differ."""
    text = (REPO / "nodeagent/Dockerfile").read_text()
    lines = [
        "RUN python -m compileall -q /app" if line.startswith("RUN python -m compileall") else line
        for line in text.splitlines()
    ]
    with pytest.raises(ImageBuildError, match="checked-hash"):
        recipe_of("\n".join(lines))


@pytest.mark.slow
@pytest.mark.node
def test_real_containerd_runs_its_own_platform_from_an_index(containerd: Containerd) -> None:
    """An index of two platforms, as a release publishes: containerd takes it under its name
    and runs the manifest of this machine's CPU, not the other one's."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox not found (apt-get install busybox-static)")
    payload = Path(busybox).read_bytes()
    image = busybox_image(payload, "gpuusage.local/multi:1")
    other = Platform("arm64" if HOST.architecture == "amd64" else "amd64")
    mine = image_manifest(image, None, HOST)
    theirs = image_manifest(busybox_image(b"not for this CPU", image.name), None, other)
    containerd.import_image(index_archive(image.name, [theirs, mine]))
    assert "gpuusage.local/multi:1" in containerd.images()
    ran = containerd.run_to_end(image.name, "multi-probe", "/bin/sh", "-c", "echo ok")
    assert ran.stdout.decode().split() == ["ok"]


BYTECODE_PROBE = """
import importlib.util, json, os, sys
import gpuusage_nodeagent.main
stale, seen = [], 0
for module in list(sys.modules.values()):
    source, cached = getattr(module, "__file__", None), getattr(module, "__cached__", None)
    if not source or not cached or not source.startswith(("/app/", "/usr/")):
        continue
    seen += 1
    if not os.path.exists(cached):
        stale.append(module.__name__)
        continue
    with open(cached, "rb") as pyc, open(source, "rb") as text:
        header = pyc.read(16)
        checked = int.from_bytes(header[4:8], "little") == 3  # hash-based, checked
        if not checked or header[8:16] != importlib.util.source_hash(text.read()):
            stale.append(module.__name__)
print(json.dumps([os.getuid(), gpuusage_nodeagent.__name__,
                  open("/licenses/LICENSE").read(), sorted(stale), seen > 50]))
"""
"""In the image: every module the agent imports, ours, the dependencies' and Debian's standard
library, has its bytecode, hash-based and checked, matching its source (no start compiles, none
is stale: the layers' fixed file times would leave timestamped bytecode stale)."""


@pytest.mark.slow
@pytest.mark.node
def test_the_agent_image_runs_in_real_containerd(containerd: Containerd) -> None:
    """Built without Docker (Debian bookworm's python3 3.11 from mmdebstrap, the requirements,
    the sources), imported under the manifests' name, run by runc as uid 65532: the agent
    observes a node without NVML and prints its report."""
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap not found (apt-get install mmdebstrap)")
    (name,) = [n for n, d in product_images(REPO).items() if d == "nodeagent/Dockerfile"]
    containerd.import_image(product_image(REPO, "nodeagent/Dockerfile", name))
    assert name in containerd.images()
    ran = containerd.run_to_end(name, "agent-probe", "python", "-c", BYTECODE_PROBE)
    assert ran.returncode == 0, ran.stderr.decode()[-800:]
    # Every module the agent imports was compiled at build: none compiles at each start.
    assert json.loads(ran.stdout) == [
        65532,
        "gpuusage_nodeagent",
        (REPO / "LICENSE").read_text(),
        [],
        True,  # more than 50 modules of ours and the dependencies' were looked at
    ]
    report = containerd.run_to_end(
        name,
        "agent-once",
        "python",
        "-m",
        "gpuusage",
        "agent",
        "--once",
        "--output",
        "json",
        "--node-name",
        "n1",
        "--gpu-source",
        "none",
        "--metrics-port",
        "0",
    )
    assert report.returncode == 0, report.stderr.decode()[-800:]
    assert json.loads(report.stdout)["spec"]["source"]["kind"] == "none"


def test_the_cache_keeps_the_newest_builds_of_each_image(tmp_path: Path) -> None:
    """Each source edit makes a new build; only the newest few of one image stay, another
    image's builds (a name that merely starts the same) are left alone."""
    builds = []
    for n in range(5):
        build = tmp_path / f"ghcr.io_gpuusage_gpuusage-agent_0.1.0-{n:016x}.tar"
        build.write_bytes(b"x")
        os.utime(build, (1_000_000 + n, 1_000_000 + n))
        builds.append(build)
    other = tmp_path / "ghcr.io_gpuusage_gpuusage-agent_0.1.0-extra-0000000000000000.tar"
    other.write_bytes(b"y")
    removed = prune(builds[-1], 3)
    assert sorted(removed) == builds[:2]
    assert sorted(p for p in tmp_path.iterdir()) == sorted([*builds[2:], other])
