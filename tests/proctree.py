"""Build fake /proc trees: <root>/<pid>/{stat,cgroup,comm, cmdline} as the kernel lays them out."""

from __future__ import annotations

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
    """One process directory. stat's field 22 is the start time; comm ends with a newline."""
    directory = root / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    after_name = ["S", *(["0"] * 18), str(start_ticks), *(["0"] * 30)]
    (directory / "stat").write_text(f"{pid} ({comm}) {' '.join(after_name)}\n")
    (directory / "cgroup").write_text(cgroup if cgroup.endswith("\n") else cgroup + "\n")
    (directory / "comm").write_text(comm[:15] + "\n")
    (directory / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
    return directory
