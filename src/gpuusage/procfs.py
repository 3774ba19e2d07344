"""Small readers for /proc that several parts share.

Everything takes the proc root as an argument: the agent reads the host's /proc mounted at
another path, and tests point it at a fixture tree.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PROC_ROOT = Path("/proc")


def start_ticks(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> int | None:
    """The process start time in clock ticks since boot (field 22 of /proc/<pid>/stat).

    Together with the pid it identifies a process across pid reuse. None when the process is
    gone or the file is unreadable or malformed. Read with bare os calls: the agent does this
    for every GPU process on every cycle, and pathlib's overhead dominated the cycle's cost.
    """
    try:
        fd = os.open(f"{proc_root}/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) is in parentheses and may itself contain spaces and ')'.
    close = raw.rfind(b")")
    if close < 0:
        return None
    fields = raw[close + 1 :].split()
    # After the name come fields 3.. ; start time is field 22, i.e. index 19 here.
    if len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def cmdline(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> list[str] | None:
    """The argument vector of a process, or None when it cannot be read.

    Used only for recognising our own child processes; never published, since command lines
    can carry secrets.
    """
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def pids(proc_root: Path = DEFAULT_PROC_ROOT) -> list[int]:
    """All numeric entries of the proc root, i.e. the visible processes."""
    try:
        return sorted(int(entry.name) for entry in proc_root.iterdir() if entry.name.isdigit())
    except OSError:
        return []


def uptime(proc_root: Path = DEFAULT_PROC_ROOT) -> float | None:
    """Seconds since boot (the first field of /proc/uptime), the clock of start_ticks; None
    when unreadable."""
    try:
        with open(f"{proc_root}/uptime", "rb") as f:
            return float(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def own_pid_namespace(proc_root: Path = DEFAULT_PROC_ROOT) -> bool | None:
    """Whether `proc_root` shows the reader's own pid namespace: procfs names the reader's pid,
    as the namespace the mount belongs to numbers it, in `self`. None: cannot tell (no `self`,
    as in a test's tree)."""
    try:
        return os.readlink(proc_root / "self") == str(os.getpid())
    except OSError:
        return None
