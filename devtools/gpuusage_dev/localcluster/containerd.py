"""A containerd of our own for the local cluster's real node, rooted in one folder.

containerd 1.7, built from Go modules like the control plane (tools.CONTAINERD: Debian 12's 1.6
ignores the CDI devices a DRA driver prepares), and Debian's runc run it as root. Its CRI
plugin reads CDI specs from CDI_DIR, where DRA drivers write them on real nodes. Everything else
it keeps lives under the folder:
root, state, socket, and the `opt` plugin's path (else it makes /opt/containerd). The CRI plugin
restricts the OOM score adjustment (runc fails without that where root lacks CAP_SYS_RESOURCE,
as in some sandboxes), uses the cgroupfs driver (runc's SystemdCgroup off) and
a pause image we import ourselves (images), so nothing is pulled from a registry.

Its containers start with the fd limits containerd 2 gives them (1,024 soft, 524,288 hard,
or this machine's hard limit where lower), through a base runtime spec: containerd 1.6 would
hand them its own limits, raised to the hard one by the Go runtime (containerd/containerd#8249),
and hide whether a process in a pod copes with a low soft limit (the agent raises its own).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuusage.errors import GpuusageError
from gpuusage.retry import poll_until
from gpuusage_dev.localcluster.cluster import stop_child

NEEDED = ("runc",)
CDI_DIR = Path("/var/run/cdi")
"""Where the CRI plugin reads CDI specs: the standard dynamic folder, where NVIDIA's DRA driver
and the local node's own write them."""


class NodeUnavailable(GpuusageError):
    """This machine cannot run a local node (not root, or containerd/runc missing)."""


def node_prerequisites() -> str | None:
    """Why this machine cannot run a node, or None when it can."""
    if os.geteuid() != 0:
        return "a local node runs containers and cgroups of its own: it needs root"
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: a local node needs the distribution's runc and "
            "CNI plugins (apt-get install runc containernetworking-plugins)"
        )
    return None


CONTAINER_FDS = (1024, 524_288)
"""(soft, hard) RLIMIT_NOFILE of a container under containerd 2 (systemd's default, which its
unit no longer overrides: containerd/containerd#8924)."""


def base_spec(default: dict[str, Any], hard_here: int) -> dict[str, Any]:
    """The runtime's default spec (`ctr oci spec`) with containerd 2's fd limits for every
    container; the hard one no higher than `hard_here` (raising it needs CAP_SYS_RESOURCE,
    which root lacks in some sandboxes)."""
    soft, hard = CONTAINER_FDS
    if hard_here != resource.RLIM_INFINITY:
        hard = min(hard, hard_here)
    limits = [r for r in default["process"].get("rlimits", []) if r["type"] != "RLIMIT_NOFILE"]
    limits.append({"type": "RLIMIT_NOFILE", "soft": min(soft, hard), "hard": hard})
    return {**default, "process": {**default["process"], "rlimits": limits}}


def config_text(
    directory: Path,
    sandbox_image: str,
    cni_conf: Path,
    cni_bin: Path,
    spec: Path,
    *,
    cdi_dir: Path = CDI_DIR,
) -> str:
    """containerd's config (version 2) with everything under `directory` but the CDI specs it
    reads; `spec`: the base runtime spec of its containers."""
    return f"""version = 2
root = "{directory / "root"}"
state = "{directory / "state"}"

[grpc]
  address = "{directory / "containerd.sock"}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{directory / "opt"}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_cdi = true
  cdi_spec_dirs = ["{cdi_dir}"]

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  base_runtime_spec = "{spec}"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "{cni_bin}"
  conf_dir = "{cni_conf}"
"""


SOCKET_PATH_MAX = 104
"""The longest unix socket path containerd accepts (BSD's sun_path; Linux allows 107)."""

TTRPC_SOCKET = "containerd.sock.ttrpc"
"""containerd's deepest socket below its folder (its ttrpc endpoint, beside the gRPC one)."""


def socket_too_long(socket_path: Path) -> str | None:
    """Why a unix socket cannot be made at `socket_path` (the daemon would fail on its own,
    after its timeout and far from the cause), or None."""
    resolved = socket_path.resolve()
    if len(str(resolved)) <= SOCKET_PATH_MAX:
        return None
    return f"{resolved} is {len(str(resolved))} characters, more than {SOCKET_PATH_MAX}"


class Containerd:
    """One containerd process rooted in `directory`."""

    def __init__(
        self,
        directory: Path,
        *,
        sandbox_image: str = "gpuusage.local/pause:1",
        cni_bin: Path = Path("/usr/lib/cni"),
    ) -> None:
        self.directory = directory.resolve()
        self.sandbox_image = sandbox_image
        self.cni_bin = cni_bin
        self._process: subprocess.Popen[bytes] | None = None
        self._binary: Path | None = None

    @property
    def binary(self) -> Path:
        """containerd (built once, see tools.CONTAINERD); its shim and `ctr` lie beside it."""
        if self._binary is None:
            from gpuusage_dev.localcluster.tools import CONTAINERD, ensure_tool  # noqa: PLC0415

            self._binary = ensure_tool(CONTAINERD)
        return self._binary

    @property
    def ctr_binary(self) -> Path:
        return self.binary.with_name("ctr")

    @property
    def pid(self) -> int:
        if self._process is None:
            raise NodeUnavailable("containerd is not running")
        return self._process.pid

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def cni_conf(self) -> Path:
        return self.directory / "cni" / "net.d"

    def start(self, timeout: float = 30.0) -> None:
        if deep := socket_too_long(self.directory / TTRPC_SOCKET):
            raise NodeUnavailable(
                f"containerd's folder is too deep for its sockets ({deep}): pick a shorter one"
            )
        why = node_prerequisites()
        if why is not None:
            raise NodeUnavailable(why)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cni_conf.mkdir(parents=True, exist_ok=True)
        spec = self.directory / "base-spec.json"
        default = subprocess.run(
            [str(self.ctr_binary), "oci", "spec"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        _, hard_here = resource.getrlimit(resource.RLIMIT_NOFILE)
        spec.write_text(json.dumps(base_spec(json.loads(default.stdout), hard_here), indent=1))
        config = self.directory / "config.toml"
        config.write_text(
            config_text(self.directory, self.sandbox_image, self.cni_conf, self.cni_bin, spec)
        )
        log = (self.directory / "containerd.log").open("ab")
        path = f"{self.binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"  # its shim
        self._process = subprocess.Popen(
            [str(self.binary), "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PATH": path},
        )
        if not poll_until(self._answers, timeout, 0.2):
            self.stop()
            tail = (self.directory / "containerd.log").read_text(errors="replace")[-2000:]
            raise NodeUnavailable(f"containerd did not answer within {timeout:.0f} s:\n{tail}")

    def _answers(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            return False
        return self.socket.exists() and self.ctr("version", check=False).returncode == 0

    def ctr(
        self, *args: str, check: bool = True, input_bytes: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """`ctr` on this containerd, in Kubernetes' namespace (k8s.io)."""
        return subprocess.run(
            [str(self.ctr_binary), "-a", str(self.socket), "-n", "k8s.io", *args],
            input=input_bytes,
            capture_output=True,
            check=check,
            timeout=120,
        )

    def run_to_end(self, image: str, name: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
        """Run argv in a fresh container of image until it ends; what it printed comes back.

        The container writes its output to files in a folder bound from here, through the
        image's /bin/sh: `ctr run` copies a container's output through FIFOs and can lose a
        short-lived one's (containerd/containerd#770), as CI saw. ctr's exit status is the
        command's."""
        folder = Path(tempfile.mkdtemp(prefix="run-", dir=self.directory))
        try:
            folder.chmod(0o777)  # images may run as another user (the agent's: 65532)
            ran = self.ctr(
                "run",
                "--rm",
                "--mount",
                f"type=bind,src={folder},dst=/gpuusage-run,options=rbind:rw",
                image,
                name,
                "/bin/sh",
                "-c",
                f"{shlex.join(argv)} >/gpuusage-run/out 2>/gpuusage-run/err",
                check=False,
            )
            printed = {
                n: (folder / n).read_bytes() if (folder / n).exists() else b""
                for n in ("out", "err")
            }
            return subprocess.CompletedProcess(
                ran.args, ran.returncode, printed["out"], printed["err"] + ran.stderr
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def import_image(self, archive: bytes) -> None:
        """Import an OCI image archive (see images.oci_archive) under its own name."""
        self.ctr("images", "import", "-", input_bytes=archive)

    def images(self) -> list[str]:
        listed = self.ctr("images", "ls", "-q").stdout.decode().split()
        return [name for name in listed if not name.startswith("sha256:")]

    def stop(self, timeout: float = 15.0) -> None:
        """Stop containerd and leave no mount of its behind under the folder."""
        process, self._process = self._process, None
        stop_child(process, timeout)
        unmount_below(self.directory)


def mounts_below(directory: Path) -> list[str]:
    """Mount points under `directory`, deepest first (the order to unmount them in)."""
    prefix = f"{directory}/"
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point.startswith(prefix) or point == str(directory):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def unmount_below(directory: Path, attempts: int = 5) -> None:
    """Lazily unmount everything under `directory` (a stopped runtime's overlays, shm)."""
    for _ in range(attempts):
        points = mounts_below(directory)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        time.sleep(0.1)
