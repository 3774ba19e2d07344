"""Whether the process under a pid is still the one the resolver read: one identity per pid,
read for all listed pids at once each cycle.

The resolver answers a pid from its cache while the process under it is the one its files
were read from (see resolver). The identity is the (inode, mtime) of `<proc-root>/<pid>/stat`:
procfs makes a new inode for a new process under a reused pid, so a reuse shows as another
identity. One stat per listed pid per cycle, under any proc root: the agent's own `/proc`
(hostPID) or the host's mounted without it. A pidfd held per pid once stood beside it as a
cheaper way; the agent's cycle stays well within its target without it (benchmarks/README.md,
"Agent: one way to tell a reused pid").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

Identity = tuple[int, int]
"""(inode, mtime in ns) of the pid's stat file: equal only for the same process."""


class StatIdentities:
    """The identity from a stat of `<proc-root>/<pid>/stat` (see the module docstring)."""

    def __init__(self, proc_root: Path) -> None:
        self._prefix = f"{proc_root}/"

    def one(self, pid: int) -> Identity | None:
        """The pid's identity now; None: no process has it under the proc root."""
        try:
            st = os.stat(f"{self._prefix}{pid}/stat")
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def of(self, pids: Sequence[int]) -> dict[int, Identity | None]:
        return {pid: self.one(pid) for pid in pids}
