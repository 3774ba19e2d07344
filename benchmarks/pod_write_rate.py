"""Pod writes per GPU pod-hour, for three patterns of use, through the operator's own marks rules.

Each pattern is a memory trace of one pod's one process, sampled every agent cycle (10 s). The
agent publishes when the process's memory moved by its --memory-threshold-mib (64) or, steady,
every 300 s (the refresh of a node its Lease vouches for). Each publication is a reconcile:
the judge's marks for the pod in use (`judge.podstate.mark_of`) planned against what the pod
shows (`writers.marks.plan_pod`); each annotation or condition patch is one pod write. Where
the plan holds detail back until a time (`PodPlan.due`, where the code has it), the report is
judged again then with what it says, as the work queue's deadline would.

Run it with each side's sources first on the path to compare them, side by side:

    PYTHONPATH=<checkout>/src:<checkout>/operator .venv/bin/python benchmarks/pod_write_rate.py

Patterns (seeded, so both sides see the same traces):
  training   a caching allocator growing from 2 to 38 GiB over 20 minutes, then a plateau with
             the allocator's small moves and a 256 MiB bump every 7 minutes;
  inference  a steady 12 GiB with the KV cache breathing (about +-100 MiB) and a 512 MiB swing
             every 5 minutes;
  notebook   1 GiB between bursts; every 20 minutes a burst of 3 to 5 minutes to 10-20 GiB,
             freed at its end.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuusage.api.models import Process
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.podstate import Verdict, mark_of
from gpuusage_operator.judge.resolution import PodUse, Resolution
from gpuusage_operator.writers.marks import plan_pod

START = datetime(2026, 11, 28, 0, 0, tzinfo=UTC)
CYCLE = 10.0
THRESHOLD_MIB = 64
REFRESH = 300.0
POD = PodSnapshot("ml", "p-0", "0b6c3a52-9d0e-4b8e-8f1a-2c3d4e5f6a7b", "gpu-node-a", gpu_requests=1)
DEVICE = "GPU-11111111-2222-3333-4444-555555555555"


def training(rng: random.Random, seconds: float) -> Iterator[int]:
    t = 0.0
    while t < seconds:
        if t < 1200:
            mib = 2048 + (38 * 1024 - 2048) * t / 1200 + rng.uniform(-150, 150)
        else:
            mib = 38 * 1024 + rng.uniform(-40, 40) + (256 if (t // 420) % 2 else 0)
        yield int(mib)
        t += CYCLE


def inference(rng: random.Random, seconds: float) -> Iterator[int]:
    t = 0.0
    while t < seconds:
        swing = 512 if (t // 300) % 2 else 0
        yield int(12 * 1024 + swing + rng.uniform(-100, 100))
        t += CYCLE


def notebook(rng: random.Random, seconds: float) -> Iterator[int]:
    t, burst_end, peak = 0.0, -1.0, 0
    while t < seconds:
        if t % 1200 < CYCLE:
            burst_end, peak = t + rng.uniform(180, 300), rng.randint(10, 20) * 1024
        mib = peak + rng.uniform(-200, 200) if t < burst_end else 1024 + rng.uniform(-20, 20)
        yield int(mib)
        t += CYCLE


PATTERNS = {"training": training, "inference": inference, "notebook": notebook}


def use_at(mib: int, observed: datetime) -> PodUse:
    process = Process.model_validate({"pid": 4242, "usedMemoryMiB": mib})
    return PodUse(POD, "gpu-node-a", observed, (Resolution(DEVICE, process, POD, "main"),))


def replay(trace: list[int]) -> dict[str, Any]:
    """The pod writes the operator's rules make for one trace, and how far behind the truth
    the pod's memory annotation was."""
    annotations: dict[str, str] = {}
    condition: dict[str, Any] | None = None
    writes, write_times = 0, []
    published: int | None = None
    published_at = START
    due: datetime | None = None
    lag = 0
    for n, mib in enumerate(trace):
        now = START + timedelta(seconds=n * CYCLE)
        refresh = (now - published_at).total_seconds() >= REFRESH
        if published is None or abs(mib - published) >= THRESHOLD_MIB or refresh:
            published, published_at = mib, now
            judge = True
        else:
            judge = due is not None and now >= due
        if judge:
            verdict = Verdict(POD, "InUse", use_at(published, published_at))
            plan = plan_pod(mark_of(verdict, "gpu-node-a"), annotations, condition, now)
            for patch in (plan.annotation_patch, plan.condition_patch):
                if patch is not None:
                    writes += 1
                    write_times.append(now)
            annotations, condition = dict(plan.annotations), dict(plan.condition)
            due = getattr(plan, "due", None)
        shown = int(annotations.get("gpuusage.io/gpu-memory-mib", "0"))
        lag = max(lag, abs(shown - mib))
    hours = len(trace) * CYCLE / 3600
    window = timedelta(minutes=10)
    busiest = max(
        (sum(1 for w in write_times if t <= w < t + window) for t in write_times), default=0
    )
    return {
        "writes": writes,
        "per_pod_hour": round(writes / hours, 1),
        "most_in_any_10_min": busiest,
        "largest_gap_mib": lag,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    out = {}
    for name, pattern in PATTERNS.items():
        trace = list(pattern(random.Random(args.seed), args.hours * 3600))
        out[name] = replay(trace)
    print(json.dumps({"hours": args.hours, "seed": args.seed, "patterns": out}, indent=2))


if __name__ == "__main__":
    main()
