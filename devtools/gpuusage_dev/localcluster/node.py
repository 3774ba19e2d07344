"""One real node for the local control plane: kube-scheduler, kube-controller-manager, a
containerd of our own, a CNI bridge, a kubelet registered as `system:node:NAME` and the GPUs
served by our device plugin or, with `gpu_allocation="dra"`, by our DRA driver (draplugin), all
rooted in one folder and stopped without leaving anything behind.

What the machine needs and what it touches (docs/local-cluster.md, "A real node"): root;
Debian's runc and CNI plugins (containerd 1.7 built from Go modules); the kubelet's fixed
device-plugin folder (/var/lib/kubelet/device-plugins, so one node per machine); `kubepods`
cgroups; three sysctls the kubelet sets (restored on stop); a bridge and network namespaces
(removed on stop).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from gpuusage.kube.errors import ApiError
from gpuusage.kube.rest import RestClient
from gpuusage.retry import poll_until
from gpuusage_dev.deviceplugin import DevicePlugin, scenario_resources
from gpuusage_dev.draplugin import DRIVER, DraPlugin, cdi_spec_path, device_classes, driver_config
from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.binaries import (
    NodeBinaries,
    cache_root,
    ensure_node_binaries,
    file_lock,
)
from gpuusage_dev.localcluster.cluster import (
    LocalCluster,
    ProcessRecord,
    audit_args,
    is_running,
    kill,
    record_of,
    terminate,
)
from gpuusage_dev.localcluster.containerd import (
    CDI_DIR,
    TTRPC_SOCKET,
    Containerd,
    NodeUnavailable,
    node_prerequisites,
    socket_too_long,
    unmount_below,
)
from gpuusage_dev.localcluster.images import busybox_image, oci_archive, pause_image
from gpuusage_dev.localcluster.pki import client_certificate
from gpuusage_dev.localcluster.platforms import HOST
from gpuusage_dev.localcluster.productimages import REPO, product_image, product_images

DEFAULT_SCENARIO: dict[str, Any] = {
    "gpus": [
        {
            "index": i,
            "uuid": f"GPU-{i + 1}{i + 1}{i + 1}{i + 1}0000-0000-4000-8000-00000000000{i}",
            "name": "NVIDIA H100 80GB HBM3",
            "memoryTotalMiB": 81559,
        }
        for i in range(4)
    ]
}
"""Four whole GPUs: what the device plugin advertises when no scenario is given."""

SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
"""What the kubelet changes on start (its defaults for a node), restored on stop."""
BRIDGE = "gpuusage0"
CGROUP_ROOT = "gpuusage-node"
"""The kubelet's --cgroup-root: its pods' cgroups live under /gpuusage-node/kubepods, so stopping
the node removes its own cgroups and never another kubelet's."""
POD_CIDR = "10.88.0.0/24"
GPU_LABEL = "nvidia.com/gpu.present"
"""What NVIDIA's feature discovery labels GPU nodes with, and the agent's DaemonSet selects."""
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
HOST_PATHS = (
    Path("/var/lib/kubelet"),
    DEVICE_PLUGINS,
    Path("/var/lib/cni"),
    Path("/var/run/netns"),
    CDI_DIR,
    Path("/etc/cdi"),
)
"""Folders outside the node's own that the kubelet, CNI, containerd and the DRA driver make (and
the kubelet for the agent's CDI hostPath volumes, which it creates where missing): removed on
stop unless they were there before."""
CNI_CACHE = Path("/var/lib/cni/results")  # libcni's cache, fixed in containerd 1.6


def node_ip() -> str:
    """A non-loopback address of this machine (the kubelet refuses loopback; no traffic goes
    there: the apiserver does not reach the kubelet in these tests)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
        found = str(probe.getsockname()[0])
    except OSError:
        found = ""
    finally:
        probe.close()
    if not found or found.startswith("127."):
        raise NodeUnavailable("no non-loopback IPv4 address: the kubelet needs one as --node-ip")
    return found


def kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, *, user: str) -> Path:
    body = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(body))
    return path


def cni_config(ipam_dir: Path) -> dict[str, Any]:
    """A bridge without gateway or masquerade (no ip_forward, no iptables), host-local IPAM."""
    return {
        "cniVersion": "0.4.0",
        "name": "gpuusage",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "loopback"},
        ],
    }


def kubelet_config(directory: Path, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "failCgroupV1": False,
        "makeIPTablesUtilChains": False,
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "resolvConf": "",
        "podCIDR": POD_CIDR,
        "cgroupsPerQOS": True,
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "enforceNodeAllocatable": [],
        "staticPodPath": str(directory / "manifests"),
        "podLogsDir": str(directory / "pod-logs"),
    }


GpuAllocation = Literal["device-plugin", "dra"]
"""Who hands out the node's GPUs: our device plugin (`nvidia.com/gpu`, MIG devices as
`nvidia.com/mig-<profile>`), or our DRA driver (`gpu.nvidia.com` ResourceSlices, NVIDIA's
DeviceClasses, `nvidia.com/gpu` served from the DeviceClass that names it: KEP-5004)."""

NodeComponent = Literal["kubelet", "containerd", "device-plugin"]
"""The node's parts that fail on their own on a real node (upgrades, crashes, redeploys)."""
NODE_COMPONENTS: tuple[NodeComponent, ...] = get_args(NodeComponent)

NODE_MONITOR_GRACE = 30
"""Seconds without the kubelet's Lease before the node lifecycle controller says NotReady."""


class Node:
    """The node NAME of the local cluster whose apiserver is `server`, its files in `directory`."""

    def __init__(
        self,
        directory: Path,
        name: str = "",
        *,
        server: str = "",
        pki: Path | None = None,
        scenario: dict[str, Any] | None = None,
        binaries: NodeBinaries | None = None,
        product: bool = False,
        time_slicing: dict[str, int] | None = None,
        kubernetes_version: str | None = None,
        gpu_allocation: GpuAllocation = "device-plugin",
        shared: Collection[str] = (),
        partitionable: Collection[str] = (),
    ) -> None:
        """`name`, `server`, `pki` and `scenario` are needed to start it; stopping needs only
        its folder. `product`: also build the product's images (productimages) and import them
        under the names the manifests use. `time_slicing`: GPUs (UUID → N) the device plugin
        advertises as N time-slicing replicas (see deviceplugin). `kubernetes_version`: the
        kubelet's release, the control plane's (versions.choose). `gpu_allocation`: who hands
        out the GPUs (GpuAllocation); with "dra", `shared` and `partitionable` name GPUs (by
        UUID) the DRA driver publishes as shared by consumable memory or as partitionable into
        MIG devices (draplugin)."""
        self.directory = directory.resolve()
        self.kubernetes_version = versions.choose(kubernetes_version)
        self.name = name
        self.server = server
        self.pki = pki or self.directory / "pki"
        self.scenario = scenario if scenario is not None else DEFAULT_SCENARIO
        self.time_slicing = dict(time_slicing or {})
        self.gpu_allocation: GpuAllocation = gpu_allocation
        self.shared = sorted(shared)
        self.partitionable = sorted(partitionable)
        if gpu_allocation == "dra" and self.time_slicing:
            raise ValueError("time-slicing replicas are the device plugin's: not with DRA")
        self._binaries = binaries
        self.product = product
        self.containerd = Containerd(self.directory / "containerd")
        self.plugin: DevicePlugin | None = None
        self.dra: DraPlugin | None = None
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def binaries(self) -> NodeBinaries:
        if self._binaries is None:
            self._binaries = ensure_node_binaries(version=self.kubernetes_version)
        return self._binaries

    @property
    def state_path(self) -> Path:
        """The processes started, so that `stop` from another process finds them."""
        return self.directory / "node.json"

    @property
    def settings_path(self) -> Path:
        """What the node was started with, so that another process can start a part again."""
        return self.directory / "node-settings.json"

    @classmethod
    def load(cls, directory: Path) -> Node:
        """The node started in `directory` (by this or another process), able to crash and
        start its parts again; an error naming the folder when no node was started there."""
        node = cls(directory)
        try:
            saved = json.loads(node.settings_path.read_text())
        except (OSError, ValueError) as exc:
            raise NodeUnavailable(
                f"no node was started in {node.directory} (`gpuusage local-cluster up --node "
                "NAME` starts one)"
            ) from exc
        return cls(
            directory,
            saved["name"],
            server=saved["server"],
            pki=Path(saved["pki"]),
            scenario=saved["scenario"],
            product=saved["product"],
            time_slicing=saved.get("time_slicing"),
            kubernetes_version=saved.get("kubernetes_version"),
            gpu_allocation=saved.get("gpu_allocation", "device-plugin"),
            shared=saved.get("shared", ()),
            partitionable=saved.get("partitionable", ()),
        )

    def _save_settings(self) -> None:
        settings = {
            "name": self.name,
            "server": self.server,
            "pki": str(self.pki),
            "scenario": self.scenario,
            "product": self.product,
            "time_slicing": self.time_slicing,
            "kubernetes_version": self.kubernetes_version,
            "gpu_allocation": self.gpu_allocation,
            "shared": self.shared,
            "partitionable": self.partitionable,
        }
        self.settings_path.write_text(json.dumps(settings))

    def _records(self) -> list[ProcessRecord]:
        try:
            listed = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return []
        return [ProcessRecord(**r) for r in listed]

    def _remember(self, name: str, pid: int) -> None:
        """Record a started part; one started again takes its old record's place (the order
        `stop` goes by stays the order they were first started in)."""
        fresh = record_of(name, pid)
        records = self._records()
        at = next((i for i, r in enumerate(records) if r.name == name), None)
        if at is None:
            records.append(fresh)
        else:
            records[at] = fresh
        self.state_path.write_text(json.dumps([asdict(r) for r in records]))

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        why = (
            node_prerequisites()
            or another_kubelet()
            or sockets_too_long(self.directory, dra=self.gpu_allocation == "dra")
        )
        if why is not None:
            raise NodeUnavailable(why)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "manifests").mkdir(exist_ok=True)
        self._save_settings()
        self._save_sysctls()
        self._save_host_paths()
        busybox = shutil.which("busybox")
        if busybox is None:
            raise NodeUnavailable("busybox not found: apt-get install busybox-static")
        payload = Path(busybox).read_bytes()
        self.containerd.start()
        self._remember("containerd", self.containerd.pid)
        for image in (pause_image(payload), busybox_image(payload)):
            self.containerd.import_image(oci_archive(image, platform=HOST))
        if self.product:
            for name, dockerfile in product_images().items():
                self.containerd.import_image(product_image(REPO, dockerfile, name))
        conf = cni_config(self.directory / "cni" / "ipam")
        (self.containerd.cni_conf / "10-gpuusage.conflist").write_text(json.dumps(conf))
        ca = self.pki / "ca.crt"
        for component, subject in (
            ("kube-scheduler", "/CN=system:kube-scheduler"),
            ("kube-controller-manager", "/CN=system:kube-controller-manager"),
            ("kubelet", f"/O=system:nodes/CN=system:node:{self.name}"),
        ):
            cert, key = client_certificate(self.pki, component, subject)
            kubeconfig(
                self.directory / f"{component}.kubeconfig",
                self.server,
                ca,
                cert,
                key,
                user=component,
            )
        self._spawn(
            "kube-scheduler",
            [
                str(self.binaries.kube_scheduler),
                f"--kubeconfig={self.directory / 'kube-scheduler.kubeconfig'}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
            ],
        )
        self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries.kube_controller_manager),
                f"--kubeconfig={self.directory / 'kube-controller-manager.kubeconfig'}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={ca}",
                "--use-service-account-credentials=true",
                # No node IPAM (the CNI's host-local IPAM hands out addresses). The cloud
                # providers' loops, which 1.35 and 1.36 list and skip, are gone from 1.37,
                # which refuses to hear of them. No Endpoints controller: its writes of the
                # deprecated core/v1 Endpoints (for every Service with pods, the product's
                # metrics Services too) would count in apiserver_requested_deprecated_apis,
                # where the tests look for the product's and their own; nothing here reads
                # Endpoints (no kube-proxy), and EndpointSlices are still written.
                "--controllers=*,-nodeipam,-endpoints-controller",
                # NotReady 30 s after the kubelet's last Lease renewal (50 s by default)
                f"--node-monitor-grace-period={NODE_MONITOR_GRACE}s",
            ],
        )
        _create_cgroups(CGROUP_ROOT)
        config = self.directory / "kubelet-config.yaml"
        config.write_text(yaml.safe_dump(kubelet_config(self.directory, _free_port())))
        self._spawn_kubelet()
        self._wait_for_kubelet(timeout)
        self._start_device_plugin(timeout)
        self._start_dra_plugin(timeout)

    def _start_device_plugin(self, timeout: float) -> None:
        """Not with DRA: the driver publishes every GPU and MIG device of the scenario, so the
        plugin would hand out the same devices a second time, and the scheduler would give a
        pod asking `nvidia.com/gpu` the plugin's rather than the DeviceClass's."""
        resources = scenario_resources(self.scenario, self.time_slicing)
        if resources and self.gpu_allocation == "device-plugin":
            self.plugin = DevicePlugin(resources, self.directory / "device-plugin")
            self.plugin.start(timeout, on_start=lambda pid: self._remember("device-plugin", pid))

    @property
    def dra_folder(self) -> Path:
        """The DRA driver's files: its configuration, logs, dra.sock and prepared.json."""
        return self.directory / "dra-plugin"

    def dra_config(self) -> dict[str, Any]:
        """What the DRA driver publishes for this node (draplugin.driver_config)."""
        return driver_config(
            self.scenario, self.name, shared=self.shared, partitionable=self.partitionable
        )

    def _start_dra_plugin(self, timeout: float) -> None:
        """With DRA: the driver, once the kubelet has made its Node (the slices are owned by
        it), publishing with the node's own identity and registering in the kubelet's
        `<root-dir>/plugins_registry`; its CDI specs go where containerd reads them."""
        if self.gpu_allocation != "dra":
            return
        self._wait_for_node_object(timeout)
        self.dra = self._dra_plugin()
        self.dra.start(timeout, on_start=lambda pid: self._remember("dra-plugin", pid))
        self._wait_dra_registered(0, timeout)

    def _dra_plugin(self) -> DraPlugin:
        """The driver this node runs (or ran: its status lines are read from its folder)."""
        if self.dra is not None:
            return self.dra
        return DraPlugin(
            self.scenario,
            self.name,
            self.directory / "kubelet.kubeconfig",
            self.dra_folder,
            cdi_dir=CDI_DIR,
            registrar_dir=self.directory / "kubelet" / "plugins_registry",
            plugin_data_dir=self.dra_folder / "plugin",
            shared=self.shared,
            partitionable=self.partitionable,
        )

    def _wait_dra_registered(self, before: int, timeout: float) -> None:
        """Until the kubelet registered the driver more than `before` times."""
        if not self._dra_plugin().wait_registered(timeout, after=before):
            raise NodeUnavailable(
                f"the kubelet did not register the DRA driver within {timeout:.0f} s "
                f"(see {self.directory / 'kubelet.log'})"
            )

    def _wait_for_node_object(self, timeout: float) -> None:
        """Until the kubelet has registered its Node, read with the node's own identity."""
        rest, _ = RestClient.from_kubeconfig(self.directory / "kubelet.kubeconfig")

        def registered() -> bool:
            try:
                rest.get(f"/api/v1/nodes/{self.name}")
            except ApiError:
                return False
            return True

        with rest:
            if not poll_until(registered, timeout, 0.2):
                raise NodeUnavailable(f"the kubelet did not register node {self.name}")

    def install_device_classes(self, kubectl: Path, kubeconfig_path: Path) -> None:
        """With DRA: NVIDIA's DeviceClasses (`gpu.nvidia.com`, serving `nvidia.com/gpu`, and
        `mig.nvidia.com`), which a cluster admin installs with the driver; nothing otherwise."""
        if self.gpu_allocation != "dra":
            return
        listed = {"apiVersion": "v1", "kind": "List", "items": device_classes()}
        subprocess.run(
            [str(kubectl), "--kubeconfig", str(kubeconfig_path), "apply", "-f", "-"],
            input=json.dumps(listed).encode(),
            capture_output=True,
            check=True,
        )

    def _spawn_kubelet(self) -> None:
        config = self.directory / "kubelet-config.yaml"
        self._spawn(
            "kubelet",
            [
                str(self.binaries.kubelet),
                f"--config={config}",
                f"--kubeconfig={self.directory / 'kubelet.kubeconfig'}",
                f"--container-runtime-endpoint=unix://{self.containerd.socket}",
                f"--root-dir={self.directory / 'kubelet'}",
                f"--hostname-override={self.name}",
                f"--node-ip={node_ip()}",
                f"--cert-dir={self.directory / 'kubelet-pki'}",
                f"--node-labels={GPU_LABEL}=true",
                "--v=1",
            ],
        )

    def host_pid(self, container_id: str) -> int:
        """A container's main process as the host sees it (containerd's task list)."""
        for line in self.containerd.ctr("tasks", "ls").stdout.decode().splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == container_id:
                return int(fields[1])
        raise NodeUnavailable(f"containerd runs no task for container {container_id}")

    def stop_kubelet(self, timeout: float = 15.0) -> None:
        """Stop the kubelet alone, as a crash or `systemctl stop kubelet` does: containers,
        containerd and the device plugin go on running; the node's Lease and status stop."""
        for record in self._records():
            if record.name == "kubelet":
                terminate(record, timeout, self._children.pop("kubelet", None))

    def start_kubelet(self, timeout: float = 120.0) -> None:
        """Start the kubelet again with the same configuration and folders; it finds its pods
        in containerd, and our device plugin registers again once its socket is back. The DRA
        driver runs on: the new kubelet deletes the node's slices and registers the driver
        again, and the driver publishes them again (wait_ready waits for those)."""
        dra = self.gpu_allocation == "dra"
        before = self._dra_plugin().registrations() if dra else 0
        (DEVICE_PLUGINS / "kubelet.sock").unlink(missing_ok=True)  # the stopped one's
        self._spawn_kubelet()
        self._wait_for_kubelet(timeout)
        if dra:
            self._wait_dra_registered(before, timeout)

    def crash(self, component: NodeComponent, timeout: float = 15.0) -> None:
        """Kill one part with SIGKILL, as a crash or the OOM killer does: nothing of it is
        told, nothing is cleaned up. The rest runs on: containers outlive the kubelet and
        containerd (their shims hold them), the kubelet outlives the device plugin."""
        for record in self._records():
            if record.name == component:
                kill(record, self._children.pop(component, None))
        if component == "device-plugin":
            self.plugin = None
            if self.gpu_allocation == "dra":
                raise NodeUnavailable("this node runs no device plugin: DRA serves its GPUs")
        if not poll_until(lambda: not self._running(component), timeout, 0.05):
            raise NodeUnavailable(f"the node's {component} did not die within {timeout:.0f} s")

    def start_component(self, component: NodeComponent, timeout: float = 120.0) -> None:
        """Start a crashed or stopped part again with the configuration and folders it had:
        the kubelet finds its pods in containerd, containerd its shims and containers, the
        device plugin registers with the kubelet again."""
        if self._running(component):
            raise NodeUnavailable(f"the node's {component} is already running")
        if component == "kubelet":
            self.start_kubelet(timeout)
        elif component == "containerd":
            self.containerd.start(timeout)
            self._remember("containerd", self.containerd.pid)
        else:
            self._start_device_plugin(timeout)

    def restart(
        self, component: NodeComponent, down_for: float = 0.0, timeout: float = 120.0
    ) -> None:
        """Crash one part and start it again after `down_for` seconds (an upgrade's or a
        crash loop's outage)."""
        self.crash(component)
        if down_for > 0:
            time.sleep(down_for)  # the outage itself, not a wait for something to happen
        self.start_component(component, timeout)

    def pids(self) -> dict[str, int]:
        """The pid of each of the node's processes that runs now, by part."""
        return {r.name: r.pid for r in self._records() if is_running(r)}

    def _running(self, component: NodeComponent) -> bool:
        return any(r.name == component and is_running(r) for r in self._records())

    def _wait_for_kubelet(self, timeout: float) -> None:
        """Until the kubelet's device manager listens (its registration socket), failing with
        its log if it exits first."""
        kubelet = self._children["kubelet"]

        def up() -> bool:
            if kubelet.poll() is not None:
                tail = (self.directory / "kubelet.log").read_text(errors="replace")[-3000:]
                raise NodeUnavailable(f"the kubelet exited ({kubelet.returncode}):\n{tail}")
            return (DEVICE_PLUGINS / "kubelet.sock").exists()

        if not poll_until(up, timeout, 0.2):
            raise NodeUnavailable(
                f"the kubelet did not start its device manager in {timeout:.0f} s"
            )

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = (self.directory / f"{name}.log").open("ab")
        process = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._children[name] = process
        self._remember(name, process.pid)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop everything the node started (from its records: also after a crash, or from
        another process) and remove what it left outside its folder."""
        if self.plugin is not None:
            self.plugin.stop()
        if self.dra is not None:
            self.dra.stop()
            self.dra = None
        for record in reversed(self._records()):
            if record.name == "containerd":
                self._stop_pods()  # its shims, before it goes
            terminate(record, timeout, self._children.pop(record.name, None))
        self._stop_pods()
        self.containerd.stop()
        unmount_below(self.directory)
        _remove_cgroups(CGROUP_ROOT)
        _remove_netns()
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        for plugin_socket in DEVICE_PLUGINS.glob("*"):
            plugin_socket.unlink(missing_ok=True)  # the kubelet's and our plugin's sockets
        self._remove_cdi_specs()
        self._remove_host_paths()
        self._restore_sysctls()

    def _stop_pods(self) -> None:
        """Kill the containers' shims and processes this containerd started."""
        needle = str(self.containerd.socket)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                argv
                and argv[0].endswith(b"containerd-shim-runc-v2")
                and needle.encode() in b" ".join(argv)
            ):
                try:
                    os.killpg(int(entry.name), signal.SIGKILL)
                except OSError:
                    os.kill(int(entry.name), signal.SIGKILL)

    # -- what the node makes outside its folder ----------------------------------------------
    def _remove_cdi_specs(self) -> None:
        """The CDI specs of the claims the DRA driver still had prepared (the kubelet does not
        unprepare the claims of pods running when the node stops); another driver's are left."""
        try:
            prepared = json.loads((self.dra_folder / "plugin" / "prepared.json").read_text())
        except (OSError, ValueError):
            return
        for uid in prepared:
            cdi_spec_path(CDI_DIR, uid).unlink(missing_ok=True)

    def _save_host_paths(self) -> None:
        saved = self.directory / "host-paths.json"
        if not saved.exists():  # an earlier start's record is the machine's own state
            cached = [str(p) for p in CNI_CACHE.glob("*")] if CNI_CACHE.is_dir() else []
            record = {"paths": [str(p) for p in HOST_PATHS if p.exists()], "cniCache": cached}
            saved.write_text(json.dumps(record))

    def _remove_host_paths(self) -> None:
        saved = self.directory / "host-paths.json"
        if not saved.exists():
            return
        record = json.loads(saved.read_text())
        for cached in CNI_CACHE.glob("*") if CNI_CACHE.is_dir() else []:
            if str(cached) not in record["cniCache"]:
                cached.unlink(missing_ok=True)  # what this node's sandboxes left
        before = set(record["paths"])
        for path in sorted(HOST_PATHS, key=lambda p: -len(p.parts)):
            if str(path) in before or not path.is_dir():
                continue
            for folder in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
                if folder.is_dir() and not folder.is_symlink():
                    with contextlib.suppress(OSError):  # only what is empty: nobody else's
                        folder.rmdir()
            with contextlib.suppress(OSError):
                path.rmdir()

    # -- sysctls ---------------------------------------------------------------------------
    def _save_sysctls(self) -> None:
        saved = self.directory / "sysctls.json"
        if saved.exists():
            return  # an earlier start's: the machine's own values
        values = {key: Path(f"/proc/sys/{key}").read_text().strip() for key in SYSCTLS}
        saved.write_text(json.dumps(values))

    def _restore_sysctls(self) -> None:
        saved = self.directory / "sysctls.json"
        if not saved.exists():
            return
        for key, value in json.loads(saved.read_text()).items():
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/{key}").write_text(value)

    def wait_ready(self, kubectl: Path, kubeconfig_path: Path, timeout: float = 120.0) -> None:
        """Until the node is Ready and its allocatable shows every device the plugin lists or,
        with DRA, the apiserver lists every slice of the driver's pool (a starting kubelet
        deletes its node's slices, which the driver then publishes again)."""
        dra = self.gpu_allocation == "dra"
        wanted = {
            name: len(ids)
            for name, ids in scenario_resources(self.scenario, self.time_slicing).items()
            if not dra
        }
        slices = len(self.dra_config()["slices"]) if dra else 0

        def read(*args: str) -> dict[str, Any] | None:
            out = subprocess.run(
                [str(kubectl), "--kubeconfig", str(kubeconfig_path), *args, "-o", "json"],
                capture_output=True,
                text=True,
                check=False,
            )
            return dict(json.loads(out.stdout)) if out.returncode == 0 else None

        def published() -> bool:
            selector = f"spec.nodeName={self.name},spec.driver={DRIVER}"
            found = read("get", "resourceslices", "--field-selector", selector)
            return found is not None and len(found.get("items") or []) == slices

        def ready() -> bool:
            node = read("get", "node", self.name)
            if node is None:
                return False
            status = node.get("status", {})
            conditions = status.get("conditions") or []
            allocatable = status.get("allocatable") or {}
            return (
                any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
                and all(allocatable.get(name) == str(count) for name, count in wanted.items())
                and (not dra or published())
            )

        if not poll_until(ready, timeout, 0.5):
            raise NodeUnavailable(
                f"node {self.name} not Ready with its devices within {timeout:.0f} s "
                f"(logs in {self.directory})"
            )
        self._check_alive()

    def _check_alive(self) -> None:
        """A part this process started that has exited (the controller manager refusing a
        flag, say) fails the start here, with its log, rather than a test's wait much later."""
        for name, process in self._children.items():
            if process.poll() is not None:
                log = self.directory / f"{name}.log"
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
                raise NodeUnavailable(
                    f"{name} of node {self.name} exited with code {process.returncode}:\n{tail}"
                )


LONGEST_SOCKETS = ("kubelet/pod-resources/kubelet.sock", f"containerd/{TTRPC_SOCKET}")
"""The node's deepest sockets below its folder (the kubelet's PodResources, containerd's
ttrpc endpoint)."""
DRA_SOCKETS = (f"kubelet/plugins_registry/{DRIVER}-reg.sock", "dra-plugin/plugin/dra.sock")
"""The DRA driver's sockets below the node's folder (its registration, its gRPC service)."""


def sockets_too_long(directory: Path, *, dra: bool = False) -> str | None:
    """Why the node cannot live in `directory` because its sockets' paths would be too long,
    or None."""
    deepest = (*LONGEST_SOCKETS, *DRA_SOCKETS) if dra else LONGEST_SOCKETS
    for socket_path in (directory / s for s in deepest):
        if (why := socket_too_long(socket_path)) is not None:
            return (
                f"the node's folder {directory} is too deep for its unix sockets ({why}): "
                "pick a shorter --dir"
            )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cgroup_hierarchies() -> list[Path]:
    """Where each cgroup hierarchy is mounted (v1: one per controller; v2: the unified one)."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] in ("cgroup", "cgroup2"):
            found.append(Path(fields[1]))
    return found


def _create_cgroups(name: str) -> None:
    """The kubelet's --cgroup-root must exist in every hierarchy before it starts."""
    for hierarchy in cgroup_hierarchies():
        (hierarchy / name).mkdir(exist_ok=True)


def _remove_cgroups(name: str, timeout: float = 10.0) -> None:
    """Kill what is left in the cgroup tree `name` (pause and container processes a stopped
    runtime leaves behind) and remove the tree, in every hierarchy."""
    tops = [t for h in cgroup_hierarchies() if (t := h / name).is_dir()]

    def gone() -> bool:
        for top in tops:
            for procs in top.rglob("cgroup.procs"):
                for pid in procs.read_text().split():
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            for folder in sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
            ):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
        return not any(top.exists() for top in tops)

    if not poll_until(gone, timeout, 0.2):
        left = [str(t) for t in tops if t.exists()]
        raise NodeUnavailable(f"cgroups left behind: {', '.join(left)}")


def _remove_netns() -> None:
    for netns in Path("/var/run/netns").glob("cni-*"):
        subprocess.run(["ip", "netns", "delete", netns.name], capture_output=True, check=False)


def write_scenario(
    folder: Path,
    processes: dict[str, list[dict[str, Any]]],
    scenario: dict[str, Any] = DEFAULT_SCENARIO,
) -> None:
    """`folder`/gpus.yaml, which the agent's fake GPU source reads: the scenario's GPUs and MIG
    devices with these processes (device UUID → pid, MiB, engines), written whole and
    atomically (the agent reads it while it changes)."""

    def with_processes(device: dict[str, Any]) -> dict[str, Any]:
        found = {**device, "processes": processes.get(device["uuid"], [])}
        if device.get("migDevices") is not None:
            found["migDevices"] = [with_processes(m) for m in device["migDevices"]]
        return found

    gpus = [with_processes(g) for g in scenario["gpus"]]
    staged = folder / "gpus.new"
    staged.write_text(yaml.safe_dump({"gpus": gpus}))
    staged.replace(folder / "gpus.yaml")


def another_kubelet(socket_path: Path | None = None) -> str | None:
    """Why a node cannot start here because another kubelet serves the machine's fixed
    device-plugin socket (a node of `local-cluster up --node`, a test run, a real kubelet),
    or None. A socket file nobody answers on is a stopped kubelet's and no obstacle."""
    path = socket_path or DEVICE_PLUGINS / "kubelet.sock"
    if not path.exists():
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2)
        probe.connect(str(path))
    except OSError:
        return None
    finally:
        probe.close()
    return (
        f"another kubelet serves {path}: one node per machine (stop the other first, e.g. "
        "`gpuusage local-cluster down --dir DIR`)"
    )


def node_cluster(
    directory: Path,
    *,
    tie_to_parent: bool = False,
    apiserver_args: Sequence[str] = (),
    kubernetes_version: str | None = None,
) -> LocalCluster:
    """A local control plane a node can join as a real one does: the Node authorizer and
    NodeRestriction on (kept across restarts), an audit log of every request but those of
    Kubernetes' own components (cluster.audit_args), and any more apiserver flags."""
    return LocalCluster(
        directory,
        authorization_modes=("Node", "RBAC"),
        apiserver_args=[
            "--enable-admission-plugins=NodeRestriction",
            *audit_args(directory),
            *apiserver_args,
        ],
        tie_to_parent=tie_to_parent,
        kubernetes_version=kubernetes_version,
    )


def cannot_run_node(product: bool = False) -> str | None:
    """Why this machine cannot run a node (with the product's images), or None."""
    why = node_prerequisites()
    if why is None and shutil.which("busybox") is None:
        why = "busybox not found (apt-get install busybox-static)"
    if why is None and product and shutil.which("mmdebstrap") is None:
        why = "mmdebstrap not found (apt-get install mmdebstrap)"
    return why


@contextmanager
def running_node(
    directory: Path,
    name: str,
    *,
    product: bool = False,
    scenario: dict[str, Any] | None = None,
    apiserver_args: Sequence[str] = (),
    time_slicing: dict[str, int] | None = None,
    gpu_allocation: GpuAllocation = "device-plugin",
    shared: Collection[str] = (),
    partitionable: Collection[str] = (),
) -> Iterator[tuple[LocalCluster, Node]]:
    """A control plane and its node NAME, Ready with its devices, for the length of the block;
    one at a time on a machine (a lock: the kubelet's registration socket is fixed). With
    `gpu_allocation="dra"` the DRA driver serves the GPUs and NVIDIA's DeviceClasses are
    installed (Node)."""
    with file_lock(cache_root() / "locks" / "node.lock"):
        cluster = node_cluster(directory, tie_to_parent=True, apiserver_args=apiserver_args)
        cluster.up()
        node = Node(
            directory / "node",
            name,
            server=cluster.server,
            pki=directory / "pki",
            scenario=scenario,
            product=product,
            time_slicing=time_slicing,
            kubernetes_version=cluster.kubernetes_version,
            gpu_allocation=gpu_allocation,
            shared=shared,
            partitionable=partitionable,
        )
        try:
            node.start()
            node.install_device_classes(cluster.binaries.kubectl, cluster.kubeconfig)
            node.wait_ready(cluster.binaries.kubectl, cluster.kubeconfig)
            yield cluster, node
        finally:
            node.stop()
            cluster.down()
