"""Whether the process under a pid is still the one the resolver read: one identity per pid,
read for all listed pids at once each cycle.

The resolver answers a pid from its cache while the process under it is the one its files
were read from (see resolver). Two ways to tell, the same answer:

- `StatIdentities`: the (inode, mtime) of `<proc-root>/<pid>/stat`. procfs makes a new inode
  for a new process under a reused pid. One stat per pid per cycle: about 2.7 µs each, a
  fifth of the agent's own cycle at 64 processes.
- `PidfdIdentities`: a pidfd per listed pid (pidfd_open(2), Linux 5.3), held while the pid is
  listed. While its process lives, no other process can have its pid; once it exits, the pidfd
  turns readable. One poll(2) over all of them per cycle: about 4 µs at 64 processes. A pidfd
  names the pid as the agent's own pid namespace numbers it, so it serves only a proc root
  that is the agent's own `/proc` (hostPID); any other (the host's `/proc` without hostPID, a
  test's tree) uses stat.

A pidfd that cannot be opened (an old kernel, the agent's fd limit) and the pid of a process
whose pidfd said it exited fall back to the stat identity; the latter stays on stat while the
pid stays listed (an exited process NVML still lists keeps its /proc entry until it is reaped,
and a stat of it is what tells a reuse), until its stat identity changes: a new process, whose
pidfd is then opened.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import select
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from gpuusage import procfs

log = logging.getLogger(__name__)

Identity = tuple[str, int, int]
"""("stat", inode, mtime in ns) or ("pidfd", serial, 0): equal only for the same process."""

FD_SHARE = 4
"""At most a quarter of the agent's soft fd limit is spent on pidfds (at the default 1,024:
256; the rest of the pids use stat)."""
REFUSED = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES})
"""pidfd_open's errors that say it never works here (an old kernel, a seccomp profile): the
agent stops asking."""
UNLIMITED = 1 << 16
"""pidfds held at most where the fd limit is infinite."""


class Identities(Protocol):
    """What the resolver asks of an identity source."""

    def of(self, pids: Sequence[int]) -> dict[int, Identity | None]:
        """Each pid's identity now; None: the pid has no process under the proc root."""

    def forget_except(self, listed: Iterable[int]) -> None:
        """Drop what is kept for pids no longer listed."""

    def close(self) -> None:
        """Release what is held (pidfds)."""


class StatIdentities:
    """The identity from a stat of `<proc-root>/<pid>/stat` (see the module docstring)."""

    def __init__(self, proc_root: Path) -> None:
        self._prefix = f"{proc_root}/"

    def one(self, pid: int) -> Identity | None:
        try:
            st = os.stat(f"{self._prefix}{pid}/stat")
        except OSError:
            return None
        return ("stat", st.st_ino, st.st_mtime_ns)

    def of(self, pids: Sequence[int]) -> dict[int, Identity | None]:
        return {pid: self.one(pid) for pid in pids}

    def forget_except(self, listed: Iterable[int]) -> None:
        """Nothing is kept."""

    def close(self) -> None:
        """Nothing is held."""


class PidfdIdentities:
    """The identity from a pidfd held per listed pid (see the module docstring).

    `limit`: at most so many pidfds at once; the pids beyond use stat.
    """

    def __init__(self, proc_root: Path, limit: int) -> None:
        self._stat = StatIdentities(proc_root)
        self._limit = limit
        self._poll = select.poll()
        self._held: dict[int, tuple[int, Identity]] = {}
        """pid → (its pidfd, the identity it stands for)."""
        self._pid_of: dict[int, int] = {}
        """pidfd → pid."""
        self._exited: dict[int, Identity | None] = {}
        """pid → its stat identity when its pidfd said it exited, while it stays listed."""
        self._serial = 0
        self._told_full = False

    def of(self, pids: Sequence[int]) -> dict[int, Identity | None]:
        if self._pid_of:
            for fd, _ in self._poll.poll(0):  # readable: its process has exited
                pid = self._pid_of[fd]
                self._release(pid)
                self._exited[pid] = self._stat.one(pid)
        held = self._held
        found: dict[int, Identity | None] = {}
        for pid in pids:
            kept = held.get(pid)
            found[pid] = kept[1] if kept is not None else self._new(pid)
        return found

    def _new(self, pid: int) -> Identity | None:
        """The identity of a pid without a live pidfd: a new pidfd where one can be had."""
        if pid in self._exited:
            now = self._stat.one(pid)
            if now is None or now == self._exited[pid]:
                return now  # the exited process still there, or none at all
            del self._exited[pid]  # another process has the pid now
        if len(self._held) >= self._limit:
            if self._limit and not self._told_full:
                self._told_full = True
                log.info(
                    "%d pidfds held, the most this fd limit allows: pids beyond them are told "
                    "apart by stat",
                    self._limit,
                )
            return self._stat.one(pid)
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno in REFUSED:
                log.info("pidfd_open refused (%s): telling processes apart by stat", exc)
                self._limit = 0
            return self._stat.one(pid)  # no such process, or out of fds for now
        self._serial += 1
        identity: Identity = ("pidfd", self._serial, 0)
        self._held[pid] = (fd, identity)
        self._pid_of[fd] = pid
        self._poll.register(fd, select.POLLIN)
        return identity

    def _release(self, pid: int) -> None:
        fd, _ = self._held.pop(pid)
        del self._pid_of[fd]
        self._poll.unregister(fd)
        os.close(fd)

    def forget_except(self, listed: Iterable[int]) -> None:
        keep = set(listed)
        for pid in [pid for pid in self._held if pid not in keep]:
            self._release(pid)
        self._exited = {pid: v for pid, v in self._exited.items() if pid in keep}

    def close(self) -> None:
        for pid in list(self._held):
            self._release(pid)
        self._exited = {}

    def __len__(self) -> int:
        """pidfds held now."""
        return len(self._held)


RAISED_FD_LIMIT = 1 << 20
"""The soft fd limit the agent raises itself to at most (what containers had for years); a
hard limit of 2^30, which systemd makes of "infinity", is not taken whole."""


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft fd limit towards its hard one; (soft before, soft after).

    A container starts with its runtime's limits. containerd 2 runs at systemd's default,
    1,024 soft and 524,288 hard, and so do its containers (containerd 1.x ran at 1,048,576:
    containerd/containerd#8924, moby/moby#51485). A process may raise its soft limit up to the
    hard one without privilege; Go programs do it at start, a Python one must ask. At 1,024 the
    agent would hold at most 256 pidfds (FD_SHARE): half of 8 GPUs x 64 processes would be told
    apart by stat. A refusal leaves the limit as it was. Either is logged.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = raised_soft_limit(soft, hard)
    if target is None:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.info("fd limit stays at %d (raising it to %d: %s)", soft, target, exc)
        return soft, soft
    log.info("soft fd limit raised from %d to %d (pidfds for the listed pids)", soft, target)
    return soft, target


def raised_soft_limit(soft: int, hard: int) -> int | None:
    """The soft fd limit to raise to from (soft, hard); None: keep it (see raise_fd_limit)."""
    infinity = resource.RLIM_INFINITY
    target = RAISED_FD_LIMIT if hard == infinity else min(hard, RAISED_FD_LIMIT)
    return None if soft == infinity or soft >= target else target


def fd_limit() -> int:
    """pidfds the agent may hold: a share of its soft fd limit (see FD_SHARE)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED if soft == resource.RLIM_INFINITY else soft // FD_SHARE


def identities_for(proc_root: Path) -> Identities:
    """pidfds where they name the proc root's pids and the kernel has them; stat otherwise."""
    if hasattr(os, "pidfd_open") and procfs.own_pid_namespace(proc_root):
        return PidfdIdentities(proc_root, fd_limit())
    return StatIdentities(proc_root)
