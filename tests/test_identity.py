"""Process identities on this machine's real /proc, with real child processes: a live process
keeps its identity, an exited one that is not reaped yet keeps it (NVML may still list it), a
reaped one has none, and the resolver reads a process once and sees it go."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuusage_nodeagent.identity import StatIdentities
from gpuusage_nodeagent.resolver import Resolved, Resolver

PROC = Path("/proc")


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


def one_cycle(resolver: Resolver, pids: list[int]) -> dict[int, Resolved]:
    """The resolver's answers for one agent cycle that lists `pids`."""
    answers = resolver.resolve_all(pids)
    resolver.end_cycle()
    return answers


def test_a_live_process_keeps_its_identity_and_a_reaped_one_has_none(
    children: Callable[[], subprocess.Popen[bytes]],
) -> None:
    ids = StatIdentities(PROC)
    child, other = children(), children()
    first = ids.of([child.pid, other.pid])
    assert None not in first.values()
    assert first[child.pid] != first[other.pid], "two processes, two identities"
    assert ids.of([child.pid])[child.pid] == first[child.pid], "the same process, the same"
    exited_unreaped(child)
    assert ids.one(child.pid) == first[child.pid], "a zombie NVML may list is the one read"
    child.wait()
    assert ids.one(child.pid) is None
    assert ids.one(other.pid) == first[other.pid], "the other process is untouched"


def test_the_resolver_reads_a_process_once_and_sees_it_go(
    children: Callable[[], subprocess.Popen[bytes]],
) -> None:
    resolver = Resolver(PROC)
    child = children()
    answers = [one_cycle(resolver, [child.pid])[child.pid] for _ in range(3)]
    assert answers[0].error is None
    assert answers[0].comm == "sleep"
    assert answers == [answers[0]] * 3
    assert resolver.reads == 1, "a process read once while its identity stays"
    exited_unreaped(child)
    zombie = one_cycle(resolver, [child.pid])[child.pid]
    assert zombie == answers[0], "an exited process still listed is still the one read"
    child.wait()
    gone = one_cycle(resolver, [child.pid])[child.pid]
    assert gone.error is not None
    assert "not found" in gone.error
