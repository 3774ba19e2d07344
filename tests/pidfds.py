"""The pidfds a process holds, read from /proc as the kernel shows them: the tests of the
agent's identities count its own, the real node's test looks into the agent's."""

from __future__ import annotations

import os
from pathlib import Path


def pidfds(pid: int | str = "self") -> dict[int, int]:
    """fd → the pid it stands for (its fdinfo's `Pid:`; -1 once the process is reaped, or
    where the kernel does not say), for every pidfd the process holds. An fd closed while it
    is read is left out."""
    held: dict[int, int] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
            if target != "anon_inode:[pidfd]" and not target.startswith("pidfd:"):
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
        except FileNotFoundError:
            continue
        named = [int(line.split()[1]) for line in info.splitlines() if line.startswith("Pid:")]
        held[int(fd.name)] = named[0] if named else -1
    return held
