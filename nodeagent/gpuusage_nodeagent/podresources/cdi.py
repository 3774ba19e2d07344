"""Which GPU a DRA device is, from the CDI specs its driver wrote on the node.

The kubelet's PodResources API names a DRA device by driver, pool and device, never by UUID;
it also names the CDI devices (`vendor/class=name`) the driver prepared for the container
runtime. Those are defined in CDI spec files on the host (`/etc/cdi`, `/var/run/cdi`), and what
their container edits hand the container tells which GPU it gets:

- `NVIDIA_VISIBLE_DEVICES=<list>` in the device's `containerEdits.env` or the spec-wide one:
  GPU or MIG UUIDs, NVML indexes (`1`) or MIG indexes on their GPU (`1:0`); `void`, `none`
  and empty name no GPU (NVIDIA's claim specs carry `void` spec-wide), anything else (`all`,
  a UUID of no GPU of this node) makes the device unknown;
- device nodes `/dev/nvidia<minor>` (NVIDIA's k8s-dra-driver-gpu names GPUs only this way):
  the GPU with that minor number, when it is not in MIG mode. A MIG-mode GPU's node is what a
  MIG device of it is handed too (with `/dev/nvidia-caps` nodes that this reader does not map),
  so such a node only says the device is that GPU or one of its MIG devices.

A device whose CDI devices name exactly one GPU or MIG device of this node (and nothing that
contradicts it) gets its UUID; anything else (no CDI device, one no spec defines, a spec that
cannot be read, several GPUs, `all`) gets none: never a guess. Nothing here raises: a spec that
cannot be read is logged once and its devices are unknown.

Specs are read as the CDI library reads them: `*.json` and `*.yaml` files at the top of each
folder; a device defined in a later folder wins over an earlier one; one defined twice in the
same folder is a conflict, unknown. Files are parsed once per change (by inode, size and
modification time), and only the little a resolution needs is kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuusage.api.models import Gpu

log = logging.getLogger(__name__)

DEFAULT_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""The CDI library's default spec folders, in rising priority."""
MAX_SPEC_BYTES = 4 * 1024 * 1024
"""A spec larger than this is not read (its devices are then unknown)."""
MAX_SPEC_FILES = 4096
"""Spec files read per folder; a node holds one per prepared claim and a few static ones."""
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
NO_GPU = frozenset({"void", "none", ""})
_NODE = re.compile(r"^/dev/nvidia([0-9]{1,9})$")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)=([A-Za-z0-9_.:-]+)$")

try:  # the C loader where PyYAML has it: a claim's spec lists many driver files
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader


@dataclass(frozen=True)
class Edits:
    """What a CDI device hands a container that tells which GPU: its own edits and the
    spec-wide ones together."""

    visible: tuple[str, ...] = ()
    """The values of NVIDIA_VISIBLE_DEVICES set."""
    nodes: tuple[str, ...] = ()
    """The container paths of the /dev/nvidia<minor> device nodes."""


@dataclass(frozen=True)
class _Parsed:
    stamp: tuple[int, int, int]
    devices: Mapping[str, Edits]
    """Qualified name (`vendor/class=name`) → edits; empty for a spec that cannot be read."""


def _values(edits: Any) -> tuple[list[str], list[str]]:
    """NVIDIA_VISIBLE_DEVICES values and /dev/nvidia<minor> paths of one containerEdits."""
    if not isinstance(edits, dict):
        return [], []
    env, device_nodes = edits.get("env") or [], edits.get("deviceNodes") or []
    if not isinstance(env, list) or not isinstance(device_nodes, list):
        raise ValueError("containerEdits' env or deviceNodes is not a list")
    visible = [
        e.split("=", 1)[1]
        for e in env
        if isinstance(e, str) and e.split("=", 1)[0] == VISIBLE and "=" in e
    ]
    nodes = [
        n["path"]
        for n in device_nodes
        if isinstance(n, dict) and isinstance(n.get("path"), str) and _NODE.match(n["path"])
    ]
    return visible, nodes


def parse_spec(text: str, json_format: bool) -> dict[str, Edits]:
    """The devices one spec defines, by qualified name. Raises ValueError for a spec that is
    not one (not JSON or YAML, no kind, a device without a name)."""
    try:
        raw = json.loads(text) if json_format else yaml.load(text, Loader=_Loader)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"not {'JSON' if json_format else 'YAML'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("not a CDI spec (no mapping)")
    kind = raw.get("kind")
    devices = raw.get("devices")
    if not isinstance(kind, str) or "/" not in kind or not isinstance(devices, list):
        raise ValueError("not a CDI spec (no kind or devices)")
    common_visible, common_nodes = _values(raw.get("containerEdits"))
    found: dict[str, Edits] = {}
    for device in devices:
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("a device without a name")
        visible, nodes = _values(device.get("containerEdits"))
        qualified = f"{kind}={name}"
        if qualified in found:
            raise ValueError(f"device {qualified} defined twice")
        found[qualified] = Edits(
            tuple(visible + common_visible), tuple(dict.fromkeys(nodes + common_nodes))
        )
    return found


class SpecDirs:
    """The CDI spec folders of the host, read when asked and parsed once per file change."""

    def __init__(self, dirs: Sequence[Path] = DEFAULT_SPEC_DIRS) -> None:
        self.dirs = tuple(dirs)
        self._parsed: dict[Path, _Parsed] = {}
        self._said: dict[Path, str] = {}
        self.parses = 0
        """Files parsed in all (a file parsed again only when it changed)."""

    def devices(self) -> dict[str, Edits | None]:
        """Every device the specs define, by qualified name; None for one defined twice in
        the same folder (the CDI library refuses both)."""
        merged: dict[str, Edits | None] = {}
        seen: set[Path] = set()
        for folder in self.dirs:
            mine: dict[str, Edits | None] = {}
            for path in self._files(folder):
                seen.add(path)
                for name, edits in self._read(path).items():
                    mine[name] = None if name in mine else edits
            merged.update(mine)
        for gone in set(self._parsed) - seen:
            del self._parsed[gone]
        for gone in {p for p in self._said if p not in seen and p not in self.dirs}:
            del self._said[gone]  # a file that could not be read and is gone: not kept
        return merged

    def _files(self, folder: Path) -> list[Path]:
        try:
            with os.scandir(folder) as entries:
                names = sorted(
                    e.name
                    for e in entries
                    if e.name.endswith((".json", ".yaml")) and e.is_file(follow_symlinks=True)
                )
        except OSError:
            return []  # no such folder: no specs there, as for the CDI library
        if len(names) > MAX_SPEC_FILES:
            self._say(folder, f"more than {MAX_SPEC_FILES} spec files; the rest are not read")
        return [folder / n for n in names[:MAX_SPEC_FILES]]

    def _read(self, path: Path) -> Mapping[str, Edits]:
        try:
            st = path.stat()
        except FileNotFoundError:  # removed since it was listed (a claim unprepared)
            return {}
        except OSError as exc:
            self._say(path, exc.strerror or str(exc))
            return {}
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        known = self._parsed.get(path)
        if known is not None and known.stamp == stamp:
            return known.devices
        devices: Mapping[str, Edits] = {}
        try:
            if st.st_size > MAX_SPEC_BYTES:
                raise ValueError(f"larger than {MAX_SPEC_BYTES} bytes")
            with path.open("rb") as spec:
                data = spec.read(MAX_SPEC_BYTES + 1)
            if len(data) > MAX_SPEC_BYTES:
                raise ValueError(f"larger than {MAX_SPEC_BYTES} bytes")
            self.parses += 1
            devices = parse_spec(data.decode("utf-8"), path.suffix == ".json")
        except OSError as exc:  # read again next time: it may pass (a file being replaced)
            self._say(path, exc.strerror or str(exc))
            return {}
        except (ValueError, TypeError, RecursionError) as exc:  # UnicodeDecodeError: ValueError
            self._say(path, str(exc))
        else:
            self._said.pop(path, None)
        self._parsed[path] = _Parsed(stamp, devices)
        return devices

    def _say(self, path: Path, why: str) -> None:
        if self._said.get(path) != why:  # a lasting problem is logged once
            self._said[path] = why
            log.warning("CDI spec %s cannot be read: %s", path, why)


@dataclass(frozen=True)
class NodeGpus:
    """The GPUs and MIG devices the agent's source read, as CDI edits name them."""

    by_token: Mapping[str, str]
    """UUID, NVML index (`1`) or MIG index on its GPU (`1:0`) → UUID."""
    by_minor: Mapping[int, str]
    """Device-node minor → GPU UUID."""
    whole: frozenset[str]
    """GPUs known not to be in MIG mode: their device node hands the whole GPU."""
    parent: Mapping[str, str]
    """MIG UUID → its GPU's UUID."""

    @classmethod
    def of(cls, gpus: Iterable[Gpu]) -> NodeGpus:
        by_token: dict[str, str] = {}
        by_minor: dict[int, str] = {}
        whole: set[str] = set()
        parent: dict[str, str] = {}
        for gpu in gpus:
            if gpu.uuid is None:
                continue
            by_token[gpu.uuid] = by_token[str(gpu.index)] = gpu.uuid
            if gpu.minor_number is not None:
                by_minor[gpu.minor_number] = gpu.uuid
            if gpu.mig_enabled is False:
                whole.add(gpu.uuid)
            for mig in gpu.mig_devices:
                by_token[mig.uuid] = by_token[f"{gpu.index}:{mig.index}"] = mig.uuid
                parent[mig.uuid] = gpu.uuid
        return cls(by_token, by_minor, frozenset(whole), parent)


def resolve(names: Iterable[str], specs: Mapping[str, Edits | None], node: NodeGpus) -> str | None:
    """The one GPU or MIG UUID of this node that the CDI devices `names` hand a container;
    None where they name none, several, or anything this node cannot vouch for."""
    names = tuple(names)
    if not names:
        return None
    named: set[str] = set()
    within: set[str] = set()
    for name in names:
        edits = specs.get(name) if _NAME.match(name) else None
        if edits is None:
            return None  # not defined, defined twice, or not a CDI name
        for value in edits.visible:
            if value.strip() in NO_GPU:
                continue
            for token in value.split(","):
                uuid = node.by_token.get(token.strip())
                if uuid is None:
                    return None  # `all`, another node's UUID, a name this node has not
                named.add(uuid)
        for path in edits.nodes:
            match = _NODE.match(path)
            gpu = node.by_minor.get(int(match[1])) if match else None
            if gpu is None:
                return None
            (named if gpu in node.whole else within).add(gpu)
    if len(named) != 1:
        return None
    (uuid,) = named
    if any(node.parent.get(uuid, uuid) != gpu for gpu in within):
        return None  # a device node of another GPU than the one named
    return uuid
