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

import gzip
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
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
EPOCH = 0  # every file's mtime: the same inputs give the same image
GZIP_LEVEL = 6
"""Compressed layers' zlib level: the bytes depend on it and on zlib's version (the provenance
names both)."""


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


def layer_from_directory(root: Path, under: str = "", mtime: int = EPOCH) -> bytes:
    """A layer of everything below `root` (placed below `under` in the image), owned by root,
    every time `mtime`: the same tree gives the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:

        def normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, 0, 0, "root", "root"
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


@dataclass(frozen=True)
class Platform:
    """An image's OS and CPU as OCI names them (Go's GOARCH: amd64, arm64)."""

    architecture: str = "amd64"
    os: str = "linux"

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}"

    @classmethod
    def parse(cls, text: str) -> Platform:
        """`linux/arm64` → Platform("arm64")."""
        os_name, _, architecture = text.partition("/")
        if not os_name or not architecture:
            raise ValueError(f"a platform is OS/ARCHITECTURE, e.g. linux/arm64, not {text!r}")
        return cls(architecture, os_name)


@dataclass(frozen=True)
class Manifest:
    """One platform's image: its manifest and the blobs it names (layers, config)."""

    platform: Platform
    manifest: bytes
    blobs: tuple[bytes, ...]

    @property
    def descriptor(self) -> dict[str, Any]:
        return {
            "mediaType": OCI_MANIFEST,
            "digest": _digest(self.manifest),
            "size": len(self.manifest),
            "platform": {"architecture": self.platform.architecture, "os": self.platform.os},
        }


def image_manifest(
    image: Image,
    layers: Sequence[bytes] | None = None,
    platform: Platform = Platform(),
    created: str | None = None,
    compress: bool = False,
) -> Manifest:
    """The image for one platform: one layer of its files, or the given `layers` (tars, lowest
    first); `created` (RFC 3339) its creation time where one is wanted, else none: the same
    inputs give the same digests. `compress`: the layers gzipped, as a registry serves images
    to many nodes (no name, no time in the gzip header: the same bytes each time)."""
    stack = list(layers) if layers is not None else [layer_tar(image.files)]
    blobs = (
        [gzip.compress(layer, compresslevel=GZIP_LEVEL, mtime=0) for layer in stack]
        if compress
        else stack
    )
    media_type = OCI_LAYER_GZIP if compress else OCI_LAYER
    history: dict[str, str] = {"created_by": "gpuusage_dev.localcluster.images"}
    config_fields: dict[str, Any] = {}
    if created is not None:
        config_fields["created"] = history["created"] = created
    config = json.dumps(
        {
            **config_fields,
            "architecture": platform.architecture,
            "os": platform.os,
            "config": {
                "Entrypoint": list(image.entrypoint) or None,
                "Cmd": list(image.cmd) or None,
                "Env": list(image.env),
                "User": image.user,
                "Labels": dict(image.labels),
            },
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer) for layer in stack]},
            "history": [history],
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [
                {"mediaType": media_type, "digest": _digest(blob), "size": len(blob)}
                for blob in blobs
            ],
        },
        sort_keys=True,
    ).encode()
    return Manifest(platform, manifest, (*blobs, config))


def _names(name: str) -> dict[str, str]:
    """The annotations that name an image in a layout: containerd's and OCI's."""
    return {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name}


def oci_archive(
    image: Image, layers: Sequence[bytes] | None = None, platform: Platform = Platform()
) -> bytes:
    """The image as an OCI image layout in a tar, as `ctr images import` takes it: one layer of
    its files, or the given `layers` (tars, lowest first)."""
    return single_archive(image.name, image_manifest(image, layers, platform))


def single_archive(name: str, built: Manifest) -> bytes:
    """One platform's image in a layout whose index.json names its manifest `name`."""
    entry = {**built.descriptor, "annotations": _names(name)}
    del entry["platform"]  # one platform: its config names it
    return _layout(entry, [*built.blobs, built.manifest])


def index_archive(
    name: str, manifests: Sequence[Manifest], annotations: Mapping[str, str] | None = None
) -> bytes:
    """One image for several platforms: an OCI image index naming each platform's manifest,
    in a layout whose index.json names the index `name`. `annotations`: the index's own."""
    index: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [m.descriptor for m in manifests],
    }
    if annotations:
        index["annotations"] = dict(annotations)
    blob = json.dumps(index, sort_keys=True).encode()
    entry = {
        "mediaType": OCI_INDEX,
        "digest": _digest(blob),
        "size": len(blob),
        "annotations": _names(name),
    }
    return _layout(entry, [b for m in manifests for b in (*m.blobs, m.manifest)] + [blob])


def _layout(entry: dict[str, Any], blobs: Sequence[bytes]) -> bytes:
    """An OCI image layout in a tar: index.json with the one `entry`, and each blob once."""
    index = json.dumps({"schemaVersion": 2, "manifests": [entry]}, sort_keys=True).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        _add(archive, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add(archive, "index.json", index)
        _add(archive, "blobs/", type=tarfile.DIRTYPE, mode=0o755)
        _add(archive, "blobs/sha256/", type=tarfile.DIRTYPE, mode=0o755)
        written: set[str] = set()
        for blob in blobs:
            digest = _digest(blob).removeprefix("sha256:")
            if digest not in written:
                written.add(digest)
                _add(archive, f"blobs/sha256/{digest}", blob)
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
