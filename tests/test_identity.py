"""Process identities on this machine's real /proc, with real child processes: a live process
keeps its identity, an exited one loses it, and pidfds are held only while their pids are
listed."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuusage_nodeagent.identity import (
    RAISED_FD_LIMIT,
    Identities,
    PidfdIdentities,
    StatIdentities,
    identities_for,
    raised_soft_limit,
)
from gpuusage_nodeagent.resolver import Resolved, Resolver
from tests.conftest import CHILD_ENV
from tests.pidfds import pidfds

PROC = Path("/proc")
needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open here")
SOURCES: dict[str, Callable[[], Identities]] = {
    "stat": lambda: StatIdentities(PROC),
    "pidfd": lambda: PidfdIdentities(PROC, limit=64),
}


@pytest.fixture
def children() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        child = subprocess.Popen(["sleep", "600"])
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        child.wait()


def exited_unreaped(child: subprocess.Popen[bytes]) -> None:
    """Kill the child and return once it has exited, leaving it a zombie (its pid and /proc
    entry stay until it is reaped)."""
    child.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)


def held_pidfds() -> int:
    """How many pidfds this process holds. Only pidfds are counted: other threads of a test
    worker (an operator's API client, a log handler) open and close fds of their own at any
    time."""
    return len(pidfds())


def one_cycle(resolver: Resolver, pids: list[int]) -> dict[int, Resolved]:
    """The resolver's answers for one agent cycle that lists `pids`."""
    answers = resolver.resolve_all(pids)
    resolver.end_cycle()
    return answers


@pytest.mark.parametrize("kind", [pytest.param("stat"), pytest.param("pidfd", marks=needs_pidfd)])
def test_a_live_process_keeps_its_identity_and_a_reaped_one_has_none(
    kind: str, children: Callable[[], subprocess.Popen[bytes]]
) -> None:
    ids = SOURCES[kind]()
    child = children()
    first = ids.of([child.pid])[child.pid]
    assert first is not None
    assert ids.of([child.pid])[child.pid] == first, "the same process, the same identity"
    child.kill()
    child.wait()
    assert ids.of([child.pid])[child.pid] is None
    ids.close()


@needs_pidfd
def test_an_exited_process_loses_its_pidfd_identity_and_keeps_a_stat_one(
    children: Callable[[], subprocess.Popen[bytes]],
) -> None:
    """The pidfd says the process exited; the zombie NVML may still list keeps its /proc
    entry, so the pid goes on under its stat identity, without a pidfd opened again each
    cycle."""
    ids, stat = PidfdIdentities(PROC, limit=64), StatIdentities(PROC)
    child, other = children(), children()
    alive = ids.of([child.pid, other.pid])
    assert len(ids) == 2
    exited_unreaped(child)
    after = ids.of([child.pid, other.pid])
    assert after[child.pid] != alive[child.pid]
    assert after[child.pid] == stat.one(child.pid) is not None
    assert after[other.pid] == alive[other.pid], "the other process is untouched"
    assert ids.of([child.pid, other.pid]) == after, "the zombie's identity stays"
    assert len(ids) == 1, "no pidfd is held for the exited process"
    ids.close()


@needs_pidfd
def test_pidfds_are_held_only_while_their_pids_are_listed(
    children: Callable[[], subprocess.Popen[bytes]],
) -> None:
    before = held_pidfds()
    ids = PidfdIdentities(PROC, limit=64)
    pids = [children().pid for _ in range(3)]
    ids.of(pids)
    assert (len(ids), held_pidfds()) == (3, before + 3)
    ids.forget_except(pids[:1])
    assert (len(ids), held_pidfds()) == (1, before + 1)
    ids.close()
    assert (len(ids), held_pidfds()) == (0, before)


@needs_pidfd
def test_pids_beyond_the_limit_use_stat(
    children: Callable[[], subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    ids, stat = PidfdIdentities(PROC, limit=1), StatIdentities(PROC)
    first, second, third = children().pid, children().pid, children().pid
    with caplog.at_level(logging.INFO, logger="gpuusage_nodeagent.identity"):
        found = ids.of([first, second, third])
        ids.of([first, second, third])
    assert found[first] is not None
    assert found[first] != stat.one(first), "a pidfd's identity"
    assert [found[second], found[third]] == [stat.one(second), stat.one(third)]
    told = [r.getMessage() for r in caplog.records if "pidfds held" in r.getMessage()]
    assert told == [
        "1 pidfds held, the most this fd limit allows: pids beyond them are told apart by stat"
    ], "said once"
    ids.close()


def test_pidfds_only_for_the_agents_own_proc(tmp_path: Path) -> None:
    """A pidfd names a pid as the agent's pid namespace numbers it: another proc root (the
    host's /proc without hostPID, a test's tree) is read by stat."""
    assert isinstance(identities_for(tmp_path), StatIdentities)
    own = identities_for(PROC)
    assert isinstance(own, PidfdIdentities if hasattr(os, "pidfd_open") else StatIdentities)
    own.close()


@needs_pidfd
def test_the_resolver_on_pidfds_reads_a_process_once_and_sees_it_go(
    children: Callable[[], subprocess.Popen[bytes]],
) -> None:
    before = held_pidfds()
    resolver = Resolver(PROC)
    child = children()
    answers = [one_cycle(resolver, [child.pid])[child.pid] for _ in range(3)]
    assert answers[0].error is None
    assert answers[0].comm == "sleep"
    assert answers == [answers[0]] * 3
    assert resolver.reads == 1, "a process read once while its pidfd says it lives"
    exited_unreaped(child)
    zombie = one_cycle(resolver, [child.pid])[child.pid]
    assert zombie == answers[0], "an exited process still listed is still the one read"
    child.wait()
    gone = one_cycle(resolver, [child.pid])[child.pid]
    assert gone.error is not None
    assert "not found" in gone.error
    assert held_pidfds() == before
    resolver.close()


@needs_pidfd
def test_the_resolver_lets_go_of_the_pidfds_of_pids_no_longer_listed(
    children: Callable[[], subprocess.Popen[bytes]],
) -> None:
    before = held_pidfds()
    resolver = Resolver(PROC)
    kept, dropped = children().pid, children().pid
    one_cycle(resolver, [kept, dropped])
    assert held_pidfds() == before + 2
    one_cycle(resolver, [kept])
    assert held_pidfds() == before + 1, "the pidfd of a live process no longer listed is closed"
    resolver.close()
    assert held_pidfds() == before


@needs_pidfd
def test_a_refused_pidfd_open_is_not_asked_again(
    children: Callable[[], subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seccomp profile that refuses pidfd_open: stat from then on, no call per pid and
    cycle."""
    calls: list[int] = []

    def refused(pid: int, flags: int = 0) -> int:
        calls.append(pid)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "pidfd_open", refused)
    ids, stat = PidfdIdentities(PROC, limit=64), StatIdentities(PROC)
    pids = [children().pid, children().pid]
    for _ in range(3):
        assert ids.of(pids) == stat.of(pids)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("soft", "hard", "raised"),
    [
        (1024, 524_288, 524_288),  # containerd 2's containers: up to the hard limit
        (1024, 1 << 30, RAISED_FD_LIMIT),  # systemd's "infinity": not the whole of it
        (1024, resource.RLIM_INFINITY, RAISED_FD_LIMIT),
        (1024, 1024, None),  # nothing to raise to
        (RAISED_FD_LIMIT, 1 << 30, None),  # high enough already
        (1 << 21, 1 << 21, None),
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, None),
    ],
)
def test_the_soft_fd_limit_is_raised_towards_the_hard_one(
    soft: int, hard: int, raised: int | None
) -> None:
    assert raised_soft_limit(soft, hard) == raised


def test_a_process_started_at_a_low_soft_fd_limit_raises_it_and_holds_pidfds_for_512() -> None:
    """In a process of its own started as containerd 2 starts a container (a soft limit far
    under the hard one): the agent's start raises it, and 8 GPUs x 64 processes all get a
    pidfd."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256
    if hard != resource.RLIM_INFINITY and hard < 4 * 512:
        pytest.skip(f"the hard fd limit here ({hard}) leaves no room for 512 pidfds")
    script = (
        "import json, resource\n"
        "from gpuusage_nodeagent.identity import fd_limit, raise_fd_limit\n"
        "print(json.dumps([raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE),"
        " fd_limit()]))\n"
    )
    ran = subprocess.run(  # the limit set by the shell: no preexec_fn in a threaded worker
        ["sh", "-c", f'ulimit -Sn {low} && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True,
        text=True,
        check=True,
        env=CHILD_ENV,
        timeout=60,
    )
    (before, after), limits, pidfds = json.loads(ran.stdout)
    expected = raised_soft_limit(low, hard)
    assert (before, after, limits) == (low, expected, [expected, hard])
    assert pidfds >= 512
