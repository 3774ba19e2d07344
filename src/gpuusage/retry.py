"""How every loop in gpuusage waits: a backoff for retrying, and polling until something holds.

One model for the API calls (kube.errors.retried: bounded, then give up), the pod watch's
relists and kopf's requests (forever, capped), and every wait for a condition (the CRDs'
establishment, the apiserver's readiness, the demo's steps, the tests' wait_for).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Pauses between attempts: `steps`, then `then` forever (None: give up after the steps),
    each scaled by a random factor in [1 - jitter, 1] so that many clients do not retry in
    step. Iterable (afresh each time, and not Sized, so kopf counts no last attempt)."""

    steps: tuple[float, ...]
    then: float | None = None
    jitter: float = 0.5

    def delay(self, attempt: int) -> float | None:
        """The pause after failed attempt number `attempt` (0-based); None: give up."""
        if attempt < len(self.steps):
            base = self.steps[attempt]
        elif self.then is not None:
            base = self.then
        else:
            return None
        return base * random.uniform(1 - self.jitter, 1)

    @property
    def attempts(self) -> int | None:
        """How many attempts in all; None for a backoff that never gives up."""
        return None if self.then is not None else len(self.steps) + 1

    def __iter__(self) -> Iterator[float]:
        for attempt in itertools.count():
            pause = self.delay(attempt)
            if pause is None:
                return
            yield pause


def doubling(first: float, cap: float) -> Backoff:
    """first, 2x, 4x ... up to cap, then cap forever."""
    steps: list[float] = []
    while first < cap:
        steps.append(first)
        first *= 2
    return Backoff(tuple(steps), then=cap)


def poll_until(
    probe: Callable[[], T | None],
    timeout: float,
    interval: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T | None:
    """probe() every `interval` until it returns something truthy (returned) or `timeout`
    seconds passed (None: the caller raises what fits its context)."""
    deadline = clock() + timeout
    while True:
        value = probe()
        if value:
            return value
        if clock() >= deadline:
            return None
        sleep(interval)
