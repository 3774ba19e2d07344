"""What a built image is for, read from its own bytes: on each platform the interpreter and
every compiled extension module are ELF files for that CPU, and, where this machine can run that
CPU (natively or under qemu), the image's own `python -m gpuusage --version` answers in its own
root. A wheel of the wrong CPU installs without a word and fails only on the node; this is where
it is caught."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from gpuusage_dev.localcluster.images import OCI_INDEX, Platform
from gpuusage_dev.localcluster.platforms import cannot_emulate, elf_architecture
from gpuusage_dev.localcluster.productimages import ImageBuildError

INTERPRETER = "usr/bin/python3.11"
"""Debian bookworm's python3, the images' interpreter (a path in the image)."""


def layout_blobs(archive: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """An OCI layout tar's one index.json entry, and its blobs by digest."""
    blobs: dict[str, bytes] = {}
    entry: dict[str, Any] = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as layout:
        for member in layout.getmembers():
            data = layout.extractfile(member) if member.isfile() else None
            if data is None:
                continue
            if member.name == "index.json":
                (entry,) = json.loads(data.read())["manifests"]
            elif member.name.startswith("blobs/sha256/"):
                blobs["sha256:" + member.name.rsplit("/", 1)[1]] = data.read()
    return entry, blobs


PlatformImages = dict[Platform, tuple[list[bytes], dict[str, Any]]]
"""Each platform's layers (lowest first) and its image config (how it runs: Env, Entrypoint)."""


def platform_images(archive: bytes) -> PlatformImages:
    """Each platform's layers and config in an image archive: an index's every platform, or a
    single manifest's own (its config names its platform)."""
    entry, blobs = layout_blobs(archive)
    if entry.get("mediaType") == OCI_INDEX:
        manifests = [d["digest"] for d in json.loads(blobs[entry["digest"]])["manifests"]]
    else:
        manifests = [entry["digest"]]
    found: PlatformImages = {}
    for digest in manifests:
        manifest = json.loads(blobs[digest])
        config = json.loads(blobs[manifest["config"]["digest"]])
        platform = Platform(config["architecture"], config["os"])
        found[platform] = ([blobs[layer["digest"]] for layer in manifest["layers"]], config)
    return found


SHARED_LIBRARY = re.compile(r"\.so(\.\d+)*$")
"""A shared library's or extension module's name (`_yaml.cpython-311-aarch64-linux-gnu.so`,
`libc.so.6`): it must be an ELF file."""


def wrong_cpu(layers: list[bytes], platform: Platform) -> list[str]:
    """Every ELF file in the layers that is not for `platform`'s CPU, and every shared library
    that is no ELF at all ("path: what it is for"); the interpreter missing counts too."""
    wrong: list[str] = []
    interpreter = False
    for layer in layers:
        with tarfile.open(fileobj=io.BytesIO(layer)) as files:
            for member in files.getmembers():
                data = files.extractfile(member) if member.isfile() else None
                if data is None:
                    continue
                head = data.read(20)
                interpreter = interpreter or member.name == INTERPRETER
                if not head.startswith(b"\x7fELF") and not SHARED_LIBRARY.search(member.name):
                    continue
                found = elf_architecture(head)
                if found != platform.architecture:
                    wrong.append(f"{member.name}: {found or 'not a 64-bit ELF of a known CPU'}")
    if not interpreter:
        wrong.append(f"{INTERPRETER}: missing")
    return wrong


def run_version(layers: list[bytes], platform: Platform, env: list[str]) -> str:
    """What `python -m gpuusage --version` prints in the image's own root (its layers unpacked,
    then chroot, with the image's own environment `env`; another CPU under qemu). Root only."""
    why = cannot_emulate(platform)
    if why is not None:
        raise ImageBuildError(why)
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    with tempfile.TemporaryDirectory(prefix="gpuusage-rootfs-") as work:
        root = Path(work)
        for layer in layers:
            with tarfile.open(fileobj=io.BytesIO(layer)) as files:
                files.extractall(root, filter="tar")  # nothing written outside the root
        try:
            ran = subprocess.run(
                [chroot, str(root), "/usr/bin/python3", "-m", "gpuusage", "--version"],
                env=dict(entry.split("=", 1) for entry in env if "=" in entry),
                capture_output=True,
                text=True,
                check=False,
                timeout=300,
            )
        except subprocess.TimeoutExpired as error:
            raise ImageBuildError(f"--version on {platform} took over 300 s") from error
    if ran.returncode != 0:
        raise ImageBuildError(f"python -m gpuusage --version failed on {platform}: {ran.stderr}")
    return ran.stdout.strip()


def can_run_images() -> str | None:
    """Why this machine cannot unpack and run an image's root here, or None."""
    return None if os.geteuid() == 0 else "unpacking an image's root and chroot need root"
