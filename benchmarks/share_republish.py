"""How often steady tenants' compute shares would rewrite their node's report, and how soon a real
move is published, at each --share-window, under the agent's republish rule.

Three steady tenants (duties 1.0, 0.5, 0.2) share one GPU of the driver model
(gpusource.drivermodel), read as the agent reads it (share.ShareSchedule every 2 s on average,
share.ShareTracker, a cycle every 10 s), for an hour; after it, the second tenant's duty drops to
0.1 for half an hour. Each cycle, the shares are compared with the last published ones by the
rule given, side by side: the fixed threshold of 0.05 the agent had, and change.shares_moved
(the estimates' own noise): a move is a publication (a report write, where nothing else
changed). Counted: publications in the steady hour, the distinct share sets
published in its first minute after the window filled, and the minutes from the drop until it
was published.

    PYTHONPATH=<sources> .venv/bin/python benchmarks/share_republish.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuusage.api.summary import share_moved
from gpuusage_nodeagent.change import Shares, shares_moved
from gpuusage_nodeagent.gpusource.drivermodel import Sampler, Work
from gpuusage_nodeagent.gpusource.sampling import share_batch
from gpuusage_nodeagent.share import SHARE_READ_SPAN, ShareSchedule, ShareTracker

CYCLE = 10.0
DUTIES = (1.0, 0.5, 0.2)
STEADY = 3600.0
AFTER = 1800.0


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def fixed(old: Shares, new: Shares) -> bool:
    """The rule before the shares' precision: a fixed 0.05, whatever the window."""
    return any(
        (a is None) != (b is None) or bool(a and b and share_moved(a[0], b[0], 0.05))
        for a, b in zip(old, new, strict=True)
    )


RULES: dict[str, Callable[[Shares, Shares], bool]] = {
    "fixed 0.05": fixed,
    "precision": shares_moved,
}
KEYS = ("steady_writes_per_hour", "first_minute_sets", "drop_published_after_min")


def run(
    window: float, seed: int, moved: Callable[[Shares, Shares], bool], every: float = 2.0
) -> dict[str, Any]:
    work = {100 + i: Work(d, 90) for i, d in enumerate(DUTIES)}
    sampler = Sampler(seed)
    tracker = ShareTracker(timedelta(seconds=window), every)
    draw = random.Random(seed)
    start = 1_700_000_000.0
    sampler.advance(int(start * 1e6), work)
    schedule, at, last_read = ShareSchedule(every, draw.random), start, start
    next_read = schedule.next_at(at)
    published: Shares | None = None
    writes, first_minute, detected = 0, set[Any](), None
    filled = start + window + CYCLE
    drop = start + STEADY
    cycle_at = start + CYCLE
    batches: list[Any] = []
    while cycle_at < start + STEADY + AFTER:
        while next_read < cycle_at:
            sampler.advance(int(next_read * 1e6), work)
            since = max(next_read - SHARE_READ_SPAN, last_read)
            batches.append(
                share_batch(sampler.read(int(since * 1e6)), _at(next_read), next_read - since)
            )
            last_read = next_read
            schedule.read_at(next_read)
            next_read = schedule.next_at(next_read)
        if cycle_at >= drop and work[101].duty != 0.1:
            work[101] = Work(0.1, 90)
        sampler.advance(int(cycle_at * 1e6), work)
        found = tracker.device("GPU-x", sorted(work), batches, None, _at(cycle_at))
        batches = []
        shares: Shares = tuple(
            None if (s := found.get(pid)) is None else (round(s.value, 3), s.samples)
            for pid in sorted(work)
        )
        if cycle_at >= filled and (published is None or moved(published, shares)):
            if published is not None and cycle_at < drop:
                writes += 1
            published = shares
            second = shares[1]
            if cycle_at >= drop and detected is None and second and abs(second[0] - 0.1) < 0.15:
                detected = (cycle_at - drop) / 60
        if filled <= cycle_at < filled + 60 and published is not None:
            first_minute.add(tuple(s[0] if s else None for s in published))
        cycle_at += CYCLE
    return {
        "steady_writes_per_hour": writes,
        "first_minute_sets": len(first_minute),
        "drop_published_after_min": detected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--windows", default="30,60,120,300")
    args = parser.parse_args()
    out: dict[str, Any] = {}
    for window in (float(w) for w in args.windows.split(",")):
        for name, rule in RULES.items():
            runs = [run(window, seed, rule) for seed in range(args.seeds)]
            out[f"{window:g} s, {name}"] = {key: [r[key] for r in runs] for key in KEYS}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
