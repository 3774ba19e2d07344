"""A /proc tree as the kernel lays it out, written into a directory: what the agent reads with
--proc-root (stat, cgroup, comm and cmdline per pid). Apart from `simulation` so that what needs
only the files (the CPU benchmark, which also runs on a GPU machine without the Kubernetes
client) imports nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_process(
    root: Path,
    pid: int,
    cgroup: str,
    *,
    comm: str = "python3",
    start_ticks: int = 100_000,
    cmdline: str = "python3 train.py --token=s3cr3t",
) -> Path:
    """One /proc/<pid> directory as the kernel lays it out (stat field 22 = start time)."""
    directory = root / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    after_name = ["S", *(["0"] * 18), str(start_ticks), *(["0"] * 30)]
    # A new file, not a rewrite: procfs gives a new process a new inode, and the agent relies
    # on that to notice a reused pid without reading the start time every cycle.
    fresh = directory / ".stat.new"
    fresh.write_text(f"{pid} ({comm}) {' '.join(after_name)}\n")
    os.replace(fresh, directory / "stat")
    (directory / "cgroup").write_text(cgroup if cgroup.endswith("\n") else cgroup + "\n")
    (directory / "comm").write_text(comm[:15] + "\n")
    (directory / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
    return directory


def pod_cgroup(pod_uid: str, container_id: str) -> str:
    """The cgroup v2 line of a container of a Burstable pod (systemd driver, containerd)."""
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{pod_uid.replace('-', '_')}.slice/cri-containerd-{container_id}.scope\n"
    )
