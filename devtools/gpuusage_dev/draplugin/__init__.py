"""A DRA driver of ours for the local cluster's real node: a kubelet plugin under the name of
NVIDIA's GPU driver (`gpu.nvidia.com`), as the device plugin stands in for NVIDIA's plugin. The
program (main.go beside this file) is built from Go modules on the upstream helper
`k8s.io/dynamic-resource-allocation/kubeletplugin` v0.37.2 and cached like the control plane.

It publishes the GPUs of a GPU scenario (the fake source's format) as ResourceSlices of one pool
named after the node, with NVIDIA's device names and attributes (`driver_config`):

- a whole GPU: `gpu-<minor>` (the scenario's `minorNumber`, else its `index`), attributes
  `type=gpu`, `uuid`, `productName`, `driverVersion`, `cudaDriverVersion`, capacity `memory`;
- a GPU with `migDevices` (MIG made beforehand): one device per MIG device with a profile in its
  name, `gpu-<minor>-mig-<profile without dots>-<profile ID>-<placement start>`, attributes
  `type=mig`, `uuid`, `parentUUID`, `profile`, `productName`, capacity `memory`;
- a GPU in `shared` (KEP-5075, consumable capacity): `gpu-<minor>` with
  `allowMultipleAllocations: true` and `memory` consumable in steps of 1Gi (a request that names
  no amount takes 1Gi), so several claims that each ask `capacity.requests.memory` land on it;
- a GPU in `partitionable` (KEP-4815, MIG made at prepare time): the whole GPU and every MIG
  placement of the profiles 1g, 2g, 3g, 4g and 7g as devices that consume counters (`memory`
  and `memory-slice-0..7`) of the counter set `gpu-<minor>-counter-set`. As with NVIDIA's driver
  on Kubernetes 1.35 and later, the counter sets live in a slice of their own (the API allows a
  slice either devices or sharedCounters), followed by one slice of devices per GPU. Such a MIG
  device has no `uuid` attribute: it is made when a claim is prepared.

Preparing a claim writes `<cdi_dir>/k8s.gpu.nvidia.com-claim_<claim UID>.json` (CDI kind
`k8s.gpu.nvidia.com/claim`, device names `<claim UID>-<device>[-<share ID>]`, as NVIDIA's
driver names them), each device setting `NVIDIA_VISIBLE_DEVICES` to the UUIDs the claim got,
and returns those CDI device IDs; unpreparing removes the file. A MIG device made at prepare time
gets a UUID the driver makes up from the parent, the device and the claim (`dynamic_mig_uuid`):
the same on every prepare of that claim, a new one for the next claim. The driver records it in
`prepared.json` in its plugin folder (`DraPlugin.created_mig_devices`), not where the agent
reads: whoever plays the GPU hardware (the test writing the scenario file the agent's fake
source reads) adds that MIG device to the scenario, as NVML would list a MIG device once it is
made. A test can equally read the UUID from the container's NVIDIA_VISIBLE_DEVICES.

The kubelet 1.37 watches `<root-dir>/plugins_registry` for registration sockets: unlike the
device plugins' socket, it moves with `--root-dir`, so a node with its own root folder passes
`registrar_dir=<root-dir>/plugins_registry`. The plugin folder (dra.sock, prepared.json) may be
anywhere the kubelet can reach: the kubelet dials the path the registration names.

ResourceSlices are published with the kubeconfig given: the node's own (`system:node:NAME`)
works where the Node authorizer and NodeRestriction are on (they let a node create, update and
delete the slices whose `nodeName` is itself, list them with that field selector, read its Node
and the claims of its pods), which is how the local node's cluster runs; an admin kubeconfig
works anywhere. The Node object must exist before slices are published (they are owned by it).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuusage.api.resources import mig_profile
from gpuusage.retry import poll_until
from gpuusage_dev.localcluster.binaries import (
    BinariesError,
    Progress,
    ensure_go_program,
    stderr_progress,
)
from gpuusage_dev.localcluster.cluster import stop_child

SOURCE = Path(__file__).with_name("main.go")
DRIVER = "gpu.nvidia.com"
REGISTRAR_DIR = Path("/var/lib/kubelet/plugins_registry")
"""The helper's default; the kubelet 1.37 watches `<root-dir>/plugins_registry` (see above)."""
PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
"""The plugin's own folder defaults to PLUGINS_DIR/<driver>, the helper's default."""
CDI_VENDOR, CDI_CLASS = "k8s.gpu.nvidia.com", "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
MODULES = (
    "k8s.io/dynamic-resource-allocation v0.37.2",
    "k8s.io/api v0.37.2",
    "k8s.io/apimachinery v0.37.2",
    "k8s.io/client-go v0.37.2",
    "k8s.io/kubelet v0.37.2",
    "k8s.io/klog/v2 v2.140.0",
    "google.golang.org/grpc v1.82.1",
)
"""The helper at Kubernetes 1.37.2 and what it is built with (its own go.mod's versions)."""

MIB = 1024 * 1024
MEMORY_SLICES = 8
"""Memory slices of a MIG-capable GPU (A100, H100, H200): what placements are counted in."""
PROFILE_IDS = {(1, 1): 19, (1, 2): 15, (2, 2): 14, (3, 4): 9, (4, 4): 5, (7, 8): 0}
"""NVML's GPU-instance profile ID by (compute slices, memory slices), as on A100/H100/H200."""
MEDIA_EXTENSIONS_ID = 20
"""The 1g profile with the media engines (`1g.10gb+me`)."""
PARTITIONS = {1: (1, range(7)), 2: (2, range(0, 6, 2)), 3: (4, (0, 4)), 4: (4, (0,)), 7: (8, (0,))}
"""Compute slices → (memory slices, placement starts) of the MIG devices a partitionable GPU
offers: NVIDIA's placements on an 8-memory-slice GPU."""
SHARE_STEP = "1Gi"
"""A shared GPU's memory is consumed in steps of this; a claim that names none takes one."""


def ensure_dra_plugin(progress: Progress = stderr_progress) -> Path:
    return ensure_go_program(
        "gpuusage-dra-plugin",
        SOURCE,
        MODULES,
        "gpuusage builds its DRA driver (the kubelet's DRA plugin API) from Go modules once.",
        progress,
    )


def dynamic_mig_uuid(parent_uuid: str, device: str, claim_uid: str) -> str:
    """The UUID the driver gives MIG device `device` (of GPU `parent_uuid`) made for a claim:
    main.go's dynamicMigUUID, so a test can know it without asking the driver."""
    raw = bytearray(hashlib.sha256(f"{parent_uuid}/{device}/{claim_uid}".encode()).digest()[:16])
    raw[6] = raw[6] & 0x0F | 0x40
    raw[8] = raw[8] & 0x3F | 0x80
    h = raw.hex()
    return f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def cdi_spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    """The CDI spec file the driver writes when it prepares the claim."""
    return cdi_dir / f"{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json"


def device_classes(extended_resource_name: str | None = "nvidia.com/gpu") -> list[dict[str, Any]]:
    """NVIDIA's DeviceClasses for this driver: `gpu.nvidia.com` (whole GPUs; with
    `extendedResourceName`, a pod asking `nvidia.com/gpu` is given one through DRA, KEP-5004)
    and `mig.nvidia.com`. Where a device plugin also advertises that extended resource on the
    node, the scheduler gives the pod the device plugin's: run one or the other for it."""

    def of(name: str, kind: str) -> dict[str, Any]:
        expression = (
            f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{kind}'"
        )
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }

    gpu = of("gpu.nvidia.com", "gpu")
    if extended_resource_name:
        gpu["spec"]["extendedResourceName"] = extended_resource_name
    return [gpu, of("mig.nvidia.com", "mig")]


def _string(value: str) -> dict[str, str]:
    return {"string": value}


def _version(text: str | None) -> dict[str, str] | None:
    """A semantic version attribute from a driver or CUDA version ("12.4" → 12.4.0)."""
    parts = (text or "").split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    return {"version": ".".join(str(int(p)) for p in ([*parts, "0", "0"])[:3])}


def _quantity_mib(mib: int) -> str:
    return f"{mib}Mi"


def profile_name(compute: int, memory_slices: int, total_mib: int) -> str:
    """NVIDIA's profile name for a MIG device of a GPU with `total_mib` ("3g.40gb" of 80 GB)."""
    gigabytes = int(total_mib / 1024 * memory_slices / MEMORY_SLICES + 0.5)
    return f"{compute}g.{gigabytes}gb"


def _name_part(profile: str) -> str:
    """The profile as NVIDIA puts it in a device name: no dots, RFC 1123 ("1g.10gb" → "1g10gb")."""
    return re.sub(r"[^a-z0-9-]", "-", profile.replace(".", "").lower()).strip("-")


def _profile_shape(profile: str, total_mib: int) -> tuple[int, int, int]:
    """(compute slices, memory slices, NVML profile ID) of a MIG profile name."""
    found = re.match(r"^(\d+)g\.(\d+)gb(\+me)?", profile)
    if not found:
        raise ValueError(f"MIG profile {profile!r} is not of the form <n>g.<m>gb")
    compute, gigabytes = int(found[1]), int(found[2])
    per_slice = total_mib / 1024 / MEMORY_SLICES
    wanted = gigabytes / per_slice if per_slice else 1
    memory = min((1, 2, 4, 8), key=lambda n: abs(n - wanted))
    if (compute, memory) not in PROFILE_IDS:
        raise ValueError(f"MIG profile {profile!r} is none of 1g, 2g, 3g, 4g, 7g on this GPU")
    ident = MEDIA_EXTENSIONS_ID if found[3] else PROFILE_IDS[compute, memory]
    return compute, memory, ident


def mig_device_name(minor: int, profile: str, profile_id: int, start: int) -> str:
    return f"gpu-{minor}-mig-{_name_part(profile)}-{profile_id}-{start}"


@dataclass(frozen=True)
class _Gpu:
    minor: int
    uuid: str
    product: str | None
    total_mib: int

    @property
    def name(self) -> str:
        return f"gpu-{self.minor}"

    @property
    def counter_set(self) -> str:
        return f"{self.name}-counter-set"


def driver_config(
    scenario: Mapping[str, Any],
    node: str,
    *,
    shared: Collection[str] = (),
    partitionable: Collection[str] = (),
) -> dict[str, Any]:
    """What main.go publishes and prepares for a GPU scenario on `node`: `driverName`, `pool`
    (the node's name), `slices` (resource.k8s.io/v1 `devices` or `sharedCounters` each) and
    `devices` (device name → what preparing it means: `uuid`, or `parentUUID` and `profile` for
    a MIG device made at prepare time; `shared`; `parent`, the whole GPU's device name).

    `shared` and `partitionable` name GPUs by UUID (see the module's docstring); a GPU cannot be
    both, and neither may have `migDevices` (MIG made beforehand). A GPU with an `error` is left
    out, as a driver leaves out a GPU it cannot read."""
    gpus = [g for g in scenario.get("gpus") or [] if not g.get("error")]
    known = {g["uuid"] for g in scenario.get("gpus") or []}
    for what, uuids in (("shared", shared), ("partitionable", partitionable)):
        unknown = sorted(set(uuids) - known)
        if unknown:
            raise ValueError(f"{what} names GPUs the scenario lacks: {', '.join(unknown)}")
    both = sorted(set(shared) & set(partitionable))
    if both:
        raise ValueError(f"a GPU cannot be both shared and partitionable: {', '.join(both)}")
    common: dict[str, dict[str, str]] = {}
    for key, text in (
        ("driverVersion", scenario.get("driverVersion", "550.54.15")),
        ("cudaDriverVersion", scenario.get("cudaVersion", "12.4")),
    ):
        version = _version(text)
        if version:
            common[key] = version
    counter_sets: list[dict[str, Any]] = []
    per_gpu: list[list[dict[str, Any]]] = []
    devices: dict[str, dict[str, Any]] = {}
    for spec in gpus:
        gpu = _Gpu(
            minor=int(spec.get("minorNumber", spec["index"])),
            uuid=str(spec["uuid"]),
            product=spec.get("name"),
            total_mib=int(spec["memoryTotalMiB"]),
        )
        attributes = {"type": _string("gpu"), "uuid": _string(gpu.uuid), **common}
        if gpu.product:
            attributes["productName"] = _string(gpu.product)
        memory: dict[str, dict[str, Any]] = {"memory": {"value": _quantity_mib(gpu.total_mib)}}
        migs = spec.get("migDevices")
        if migs is not None and (gpu.uuid in shared or gpu.uuid in partitionable):
            raise ValueError(f"{gpu.uuid} has MIG devices made beforehand: it can be neither")
        listed: list[dict[str, Any]] = []
        if migs is not None:
            listed = _static_migs(gpu, migs, common, devices)
        elif gpu.uuid in partitionable:
            counter_sets.append(_counter_set(gpu))
            listed = _partitions(gpu, attributes, common, devices)
        elif gpu.uuid in shared:
            step = {"default": SHARE_STEP, "validRange": {"min": SHARE_STEP, "step": SHARE_STEP}}
            memory["memory"]["requestPolicy"] = step
            listed = [
                {
                    "name": gpu.name,
                    "attributes": attributes,
                    "capacity": memory,
                    "allowMultipleAllocations": True,
                }
            ]
            devices[gpu.name] = {"uuid": gpu.uuid, "shared": True, "parent": gpu.name}
        else:
            listed = [{"name": gpu.name, "attributes": attributes, "capacity": memory}]
            devices[gpu.name] = {"uuid": gpu.uuid, "parent": gpu.name}
        per_gpu.append(listed)
    if counter_sets:
        slices = [{"sharedCounters": counter_sets}] + [{"devices": d} for d in per_gpu if d]
    else:
        slices = [{"devices": [d for listed in per_gpu for d in listed]}]
    return {"driverName": DRIVER, "pool": node, "slices": slices, "devices": devices}


def _static_migs(
    gpu: _Gpu,
    migs: list[dict[str, Any]],
    common: Mapping[str, Any],
    devices: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """MIG devices made beforehand, placed in the scenario's order as MIG packs them (each at
    the first free start its size allows); one without a profile in its name is left out, as
    the device plugin leaves it out."""
    listed = []
    cursor = 0
    for mig in migs:
        profile = mig_profile(mig.get("name"))
        if profile is None:
            continue
        _, memory_slices, ident = _profile_shape(profile, gpu.total_mib)
        start = -(-cursor // memory_slices) * memory_slices
        cursor = start + memory_slices
        name = mig_device_name(gpu.minor, profile, ident, start)
        attributes = {
            "type": _string("mig"),
            "uuid": _string(mig["uuid"]),
            "parentUUID": _string(gpu.uuid),
            "profile": _string(profile),
            **common,
        }
        if gpu.product:
            attributes["productName"] = _string(gpu.product)
        device: dict[str, Any] = {"name": name, "attributes": attributes}
        if mig.get("memoryTotalMiB") is not None:
            device["capacity"] = {"memory": {"value": _quantity_mib(int(mig["memoryTotalMiB"]))}}
        listed.append(device)
        devices[name] = {"uuid": mig["uuid"], "parent": gpu.name}
    return listed


def _slice_counters(start: int, size: int) -> dict[str, dict[str, str]]:
    return {f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)}


def _counter_set(gpu: _Gpu) -> dict[str, Any]:
    """The GPU's counters: its memory and each memory slice (NVIDIA counts engines and SMs as
    well, which a scenario does not describe; memory slices alone bound the placements)."""
    counters = {"memory": {"value": _quantity_mib(gpu.total_mib)}}
    return {"name": gpu.counter_set, "counters": {**counters, **_slice_counters(0, MEMORY_SLICES)}}


def _partitions(
    gpu: _Gpu,
    attributes: Mapping[str, Any],
    common: Mapping[str, Any],
    devices: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The whole GPU and every MIG placement, each consuming its part of the GPU's counters."""
    whole = _counter_set(gpu)["counters"]
    listed = [
        {
            "name": gpu.name,
            "attributes": dict(attributes),
            "capacity": {"memory": {"value": _quantity_mib(gpu.total_mib)}},
            "consumesCounters": [{"counterSet": gpu.counter_set, "counters": whole}],
        }
    ]
    devices[gpu.name] = {"uuid": gpu.uuid, "parent": gpu.name}
    for compute, (memory_slices, starts) in PARTITIONS.items():
        profile = profile_name(compute, memory_slices, gpu.total_mib)
        mib = gpu.total_mib * memory_slices // MEMORY_SLICES
        for start in starts:
            name = mig_device_name(gpu.minor, profile, PROFILE_IDS[compute, memory_slices], start)
            mig_attributes = {
                "type": _string("mig"),
                "parentUUID": _string(gpu.uuid),
                "profile": _string(profile),
                **common,
            }
            if gpu.product:
                mig_attributes["productName"] = _string(gpu.product)
            counters = {"memory": {"value": _quantity_mib(mib)}}
            counters.update(_slice_counters(start, memory_slices))
            listed.append(
                {
                    "name": name,
                    "attributes": mig_attributes,
                    "capacity": {"memory": {"value": _quantity_mib(mib)}},
                    "consumesCounters": [{"counterSet": gpu.counter_set, "counters": counters}],
                }
            )
            devices[name] = {"parentUUID": gpu.uuid, "profile": profile, "parent": gpu.name}
    return listed


class DraPlugin:
    """The driver for node `node_name`, publishing `scenario`'s GPUs with `kubeconfig`.

    `folder` (made if missing) holds what this object writes: config.json (driver_config),
    status.log (the driver's status lines) and dra-plugin.log (its log). `cdi_dir` is where the
    CDI specs go: the node's container runtime must read CDI specs from there. `registrar_dir`:
    the kubelet's plugin registration folder (`<root-dir>/plugins_registry` of the kubelet).
    `plugin_data_dir`: dra.sock and prepared.json (default PLUGINS_DIR/gpu.nvidia.com).
    `shared` and `partitionable`: GPU UUIDs published so (see driver_config).

    On the local node (what the node needs of it):
    - start it once the kubelet is up and its Node exists (the slices are owned by the Node),
      with `kubeconfig` the kubelet's own (`system:node:NAME`, which the Node authorizer and
      NodeRestriction allow this), `registrar_dir` the kubelet's `<root-dir>/plugins_registry`
      and `plugin_data_dir` a folder of the node's (dra.sock must stay under 108 characters);
      `wait_registered` then says when the kubelet took it. A kubelet that starts deletes every
      DRA slice of its node; the driver's slice controller puts them back, and the kubelet
      registers the driver again by itself (`registrations` counts how often it did).
    - the container runtime reads CDI specs from `cdi_dir`: containerd 1.7 with
      `enable_cdi = true` and `cdi_spec_dirs = [cdi_dir]` under
      `[plugins."io.containerd.grpc.v1.cri"]`; containerd 2 has CDI on and takes
      `cdi_spec_dirs` under `[plugins."io.containerd.cri.v1.runtime"]`. Containerd 1.6 has no
      CDI: its containers would start without the devices' environment, silently.
    - the kubelet needs no flag for DRA (GA, on in 1.37).
    - `device_classes()` on the cluster. For a pod asking `nvidia.com/gpu` to be given a GPU
      through DRA, the node must not also advertise `nvidia.com/gpu` from the device plugin:
      the scheduler prefers a node's allocatable extended resource to the DeviceClass.
    """

    def __init__(
        self,
        scenario: Mapping[str, Any],
        node_name: str,
        kubeconfig: Path,
        folder: Path,
        *,
        cdi_dir: Path,
        registrar_dir: Path = REGISTRAR_DIR,
        plugin_data_dir: Path | None = None,
        shared: Collection[str] = (),
        partitionable: Collection[str] = (),
        binary: Path | None = None,
    ) -> None:
        self.config = driver_config(scenario, node_name, shared=shared, partitionable=partitionable)
        self.node_name = node_name
        self.kubeconfig = kubeconfig
        self.folder = folder
        self.cdi_dir = cdi_dir
        self.registrar_dir = registrar_dir
        self.plugin_data_dir = plugin_data_dir or PLUGINS_DIR / DRIVER
        self.binary = binary or ensure_dra_plugin()
        self._process: subprocess.Popen[bytes] | None = None
        self._since = 0

    @property
    def registration_socket(self) -> Path:
        """The socket the kubelet's plugin watcher finds (GetInfo, NotifyRegistrationStatus)."""
        return self.registrar_dir / f"{DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        """The DRA gRPC socket (NodePrepareResources, NodeUnprepareResources)."""
        return self.plugin_data_dir / "dra.sock"

    @property
    def status_log(self) -> Path:
        """Status lines, a file rather than a pipe so that the driver outlives its starter."""
        return self.folder / "status.log"

    @property
    def log(self) -> Path:
        return self.folder / "dra-plugin.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            f"--config={self.folder / 'config.json'}",
            f"--kubeconfig={self.kubeconfig}",
            f"--node-name={self.node_name}",
            f"--registrar-dir={self.registrar_dir}",
            f"--plugin-data-dir={self.plugin_data_dir}",
            f"--cdi-dir={self.cdi_dir}",
            f"--status={self.status_log}",
        ]

    def start(
        self,
        timeout: float = 60.0,
        on_start: Callable[[int], None] | None = None,
        *,
        published: bool = True,
    ) -> DraPlugin:
        """Start it and wait until it serves both sockets and, with `published`, until the
        apiserver lists its slices (the Node must exist by then). `on_start` is told its pid at
        once. The kubelet's registration is not waited for: see wait_registered."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "config.json").write_text(json.dumps(self.config, indent=1))
        self._since = self.status_log.stat().st_size if self.status_log.exists() else 0
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                self.argv(), stdout=log, stderr=log, start_new_session=True
            )
        if on_start is not None:
            on_start(self._process.pid)
        wanted = ("serving", "published") if published else ("serving",)
        if not poll_until(lambda: self._said(*wanted), timeout, 0.1):
            exited = self._process.poll()
            self.stop()
            raise BinariesError(
                f"the DRA driver did not {'publish its slices' if published else 'serve'} "
                f"within {timeout:.0f} s"
                + (f" (it exited with {exited})" if exited is not None else "")
                + f"; see {self.log}"
            )
        return self

    def status_lines(self) -> list[str]:
        """The status lines written since this object last started it."""
        if not self.status_log.exists():
            return []
        with self.status_log.open("rb") as said:
            said.seek(self._since)
            return said.read().decode(errors="replace").splitlines()

    def _said(self, *words: str) -> bool:
        firsts = {line.split(" ", 1)[0] for line in self.status_lines()}
        return all(word in firsts for word in words)

    def registrations(self) -> int:
        """How often the kubelet accepted its registration (NotifyRegistrationStatus) since it
        started: once per kubelet start."""
        return sum(1 for line in self.status_lines() if line == "registered")

    def wait_registered(self, timeout: float = 60.0, after: int = 0) -> bool:
        """Whether the kubelet accepted its registration more than `after` times since it
        started, waiting up to `timeout` (`after=registrations()` before a kubelet restart
        waits for the registration after it)."""
        return bool(poll_until(lambda: self.registrations() > after, timeout, 0.1))

    def prepared(self) -> dict[str, Any]:
        """prepared.json: claim UID → namespace, name and the devices prepared for it."""
        path = self.plugin_data_dir / "prepared.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    def created_mig_devices(self) -> list[dict[str, str]]:
        """The MIG devices made at prepare time and not yet unprepared: `uuid` (made up, see
        dynamic_mig_uuid), `parentUUID`, `profile`, `device` and `claim` (UID): what whoever
        plays the hardware adds to the agent's scenario."""
        found = []
        for uid, claim in sorted(self.prepared().items()):
            for device in claim.get("devices") or []:
                if device.get("created"):
                    found.append(
                        {
                            "uuid": device["uuid"],
                            "parentUUID": device["parentUUID"],
                            "profile": device["profile"],
                            "device": device["device"],
                            "claim": uid,
                        }
                    )
        return found

    def stop(self) -> None:
        """Stop it (SIGTERM: the helper closes and removes both sockets). Its ResourceSlices
        stay, as a driver's do when it goes: the kubelet removes them once the registration is
        gone a while, and the Node's deletion does through their owner reference."""
        process, self._process = self._process, None
        stop_child(process)
