"""Container images without Docker or a registry: an OCI image archive written by hand.

A real node of the local cluster needs images its containerd can run: a pause image for pod
sandboxes and a small workload image for test pods (`gpuusage.local/busybox:1`, a static
busybox), and later the product's own. containerd imports an OCI image layout packed as a tar
(`ctr -n k8s.io images import`), so this module writes exactly that: one uncompressed layer
(a tar of the image's files), the image config (entrypoint, user, environment), the manifest,
and the layout's `index.json`, whose descriptor carries the image's name as
`io.containerd.image.name` (what containerd names it on import) and as
`org.opencontainers.image.ref.name`. Everything is content-addressed by sha256 and written
with fixed timestamps, so the same inputs give the same bytes (and the same image ID).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
EPOCH = 0  # every file's mtime: the same inputs give the same image


@dataclass(frozen=True)
class File:
    """One file of an image: its content, or (with `link`) a symbolic link to that path."""

    content: bytes = b""
    mode: int = 0o644
    link: str | None = None


@dataclass(frozen=True)
class Image:
    """What an image holds and how it runs."""

    name: str
    """Its full reference, e.g. gpuusage.local/busybox:1."""
    files: Mapping[str, File]
    """Path inside the image (no leading slash) → file; folders are made as needed."""
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Sequence[str] = ("PATH=/bin:/usr/bin",)
    user: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add(archive: tarfile.TarFile, name: str, data: bytes = b"", **fields: Any) -> None:
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "root", "root"
    for key, value in fields.items():
        setattr(info, key, value)
    if info.type == tarfile.REGTYPE:
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    else:
        archive.addfile(info)


def layer_tar(files: Mapping[str, File]) -> bytes:
    """The image's one layer: its folders, files and links, in a stable order."""
    folders = sorted({str(Path(p).parent) for p in files} - {"."})
    parents = sorted({str(parent) for f in folders for parent in Path(f).parents} - {"."})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for folder in sorted(set(folders) | set(parents)):
            _add(archive, folder + "/", type=tarfile.DIRTYPE, mode=0o755)
        for path in sorted(files):
            one = files[path]
            if one.link is not None:
                _add(archive, path, type=tarfile.SYMTYPE, linkname=one.link, mode=0o777)
            else:
                _add(archive, path, one.content, mode=one.mode)
    return buffer.getvalue()


def layer_from_directory(root: Path, under: str = "") -> bytes:
    """A layer of everything below `root` (placed below `under` in the image), owned by root,
    with fixed times: the same tree gives the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:

        def normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "root", "root"
            return info

        for parent in Path(under).parents if under else ():
            if str(parent) != ".":
                archive.addfile(normalised(_directory(str(parent))))
        for path in sorted(root.rglob("*")):
            name = (
                str(Path(under) / path.relative_to(root)) if under else str(path.relative_to(root))
            )
            archive.add(path, arcname=name, recursive=False, filter=normalised)
    return buffer.getvalue()


def _directory(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name + "/")
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def oci_archive(image: Image, layers: Sequence[bytes] | None = None) -> bytes:
    """The image as an OCI image layout in a tar, as `ctr images import` takes it: one layer of
    its files, or the given `layers` (tars, lowest first)."""
    stack = list(layers) if layers is not None else [layer_tar(image.files)]
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": list(image.entrypoint) or None,
                "Cmd": list(image.cmd) or None,
                "Env": list(image.env),
                "User": image.user,
                "Labels": dict(image.labels),
            },
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer) for layer in stack]},
            "history": [{"created_by": "gpuusage_dev.localcluster.images"}],
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [
                {"mediaType": OCI_LAYER, "digest": _digest(layer), "size": len(layer)}
                for layer in stack
            ],
        },
        sort_keys=True,
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": image.name,
                        "org.opencontainers.image.ref.name": image.name,
                    },
                }
            ],
        },
        sort_keys=True,
    ).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        _add(archive, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add(archive, "index.json", index)
        _add(archive, "blobs/", type=tarfile.DIRTYPE, mode=0o755)
        _add(archive, "blobs/sha256/", type=tarfile.DIRTYPE, mode=0o755)
        for blob in (*stack, config, manifest):
            _add(archive, f"blobs/sha256/{_digest(blob).removeprefix('sha256:')}", blob)
    return buffer.getvalue()


BUSYBOX_APPLETS = ("sh", "sleep", "cat", "ls", "echo", "true", "env", "ps", "kill", "id")


def busybox_image(busybox: bytes, name: str = "gpuusage.local/busybox:1") -> Image:
    """A static busybox (Debian's busybox-static) with its common applets as links; runs a
    shell by default."""
    files = {"bin/busybox": File(busybox, 0o755)}
    files |= {f"bin/{applet}": File(link="busybox") for applet in BUSYBOX_APPLETS}
    return Image(name, files, cmd=("/bin/sh",))


def pause_image(busybox: bytes, name: str = "gpuusage.local/pause:1") -> Image:
    """A pod sandbox's image: it only has to stay alive (busybox's `sleep infinity`)."""
    files = {"bin/busybox": File(busybox, 0o755), "bin/sleep": File(link="busybox")}
    return Image(name, files, entrypoint=("/bin/sleep", "infinity"))
