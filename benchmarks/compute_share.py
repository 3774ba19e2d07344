"""A pod's share of a shared GPU, three ways, on the driver model: its truth, gpuusage's share,
and the one-read-a-scrape method of dcgm-exporter and HAMi-core; with what the share costs.

The same tenants on one GPU's sampler (gpusource.drivermodel: about 5 instants a second, each
naming the one process on the engine, the engine sliced between those with work at the same
instant), for each scenario and seed:

* truth: the model's tally of every instant over the last `--window` seconds (what reading
  the sampler at its own rate would count);
* gpuusage: share.ShareTracker as the agent feeds it: a short read (share.SHARE_READ_SPAN)
  every `--every` seconds on average on the agent's schedule (share.ShareSchedule), never back
  past the previous read, a cycle every 10 s, the share published at the last cycle;
* anchors: one read a `--scrape` (30 s) from one second back, each tenant's latest sample's SM
  percentage as its utilization (0 where the read has none of it), averaged over the window's
  scrapes, as a Prometheus average of dcgm-exporter's per-process series would be.

Each method's error is the largest |estimate - truth| over a scenario's tenants; the table
gives its median and 95th percentile over the seeds. The cost columns put the share's reads at
the measured driver cost (driverfacts.CALL_COST_MS: nvmlDeviceGetProcessUtilization 1.7 ms at
5 processes, 3.7 ms at 64, H200) and add the tracker's own CPU per cycle as measured here, for
a node of 8 such GPUs, in percent of one core.

    python benchmarks/compute_share.py [--seeds 20] [--every 2] [--output share.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuusage_nodeagent.driverfacts import call_cost_ms
from gpuusage_nodeagent.gpusource.drivermodel import Sampler, Work
from gpuusage_nodeagent.gpusource.sampling import share_batch
from gpuusage_nodeagent.share import SHARE_READ_SPAN, ShareSchedule, ShareTracker

CYCLE = 10.0
SM = 90
"""What every sample of a tenant at work shows on the SMs (the anchors' figure)."""

SCENARIOS: dict[str, list[float]] = {
    "2 equal": [1.0, 1.0],
    "1.0/0.5/0.2": [1.0, 0.5, 0.2],
    "8 equal": [1.0] * 8,
    "8 mixed": [1.0, 0.5] + [0.2] * 6,
    "64 equal": [1.0] * 64,
}


@dataclass(frozen=True)
class Result:
    scenario: str
    processes: int
    share_error_p50: float
    share_error_p95: float
    anchor_error_p50: float
    anchor_error_p95: float
    truth: dict[int, float]
    share: dict[int, float]
    anchor: dict[int, float]
    tracker_ms_per_cycle: float
    node_core_percent: float
    """8 such GPUs: the share's reads at the driver's cost and the tracker's CPU."""


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def one_run(
    duties: Sequence[float], seed: int, *, every: float, window: float, scrape: float
) -> tuple[dict[int, float], dict[int, float], dict[int, float], float, int]:
    """Truth, gpuusage's share and the anchors' figure per pid; the tracker's CPU seconds and
    the cycles it ran."""
    work = {100 + i: Work(d, SM) for i, d in enumerate(duties)}
    sampler = Sampler(seed, history=True)
    tracker = ShareTracker(timedelta(seconds=window))
    draw = random.Random(seed)
    start = 1_700_000_000.0 + draw.random() * 10
    end = start + window + 60
    sampler.advance(int(start * 1e6), work)
    schedule, reads, at = ShareSchedule(every, draw.random), [], start
    while (at := schedule.next_at(at)) < end:
        reads.append((at, "share"))
        schedule.read_at(at)
    events = sorted(
        [(start + CYCLE * k, "cycle") for k in range(1, int((end - start) / CYCLE) + 1)]
        + reads
        + [(start + scrape * k, "scrape") for k in range(1, int((end - start) / scrape) + 1)]
    )
    batches = []
    last_read = start
    tallies: list[tuple[float, Counter[int | None]]] = []
    scrapes: list[tuple[float, dict[int, float]]] = []
    shares: dict[int, float] = {}
    cpu = 0.0
    cycles = 0
    for at, kind in events:
        now_us = int(at * 1e6)
        sampler.advance(now_us, work)
        if kind == "share":
            since = max(at - SHARE_READ_SPAN, last_read)
            samples = sampler.read(int(since * 1e6))
            batches.append(share_batch(samples, _at(at), at - since))
            last_read = at
        elif kind == "scrape":
            seen = {pid: sm / 100 for pid, _, sm, *_ in sampler.read(now_us - 1_000_000)}
            scrapes.append((at, {pid: seen.get(pid, 0.0) for pid in work}))
        else:
            began = time.process_time()
            found = tracker.device("GPU-x", sorted(work), batches, None, _at(at))
            cpu += time.process_time() - began
            cycles += 1
            batches = []
            tallies.append((at, Counter(sampler.tally)))
            shares = {pid: s.value for pid, s in found.items() if s is not None}
    last_at, last = tallies[-1]
    first = min(tallies, key=lambda t: abs(t[0] - (last_at - window)))[1]
    taken = {pid: n - first.get(pid, 0) for pid, n in last.items()}
    total = sum(taken.values())
    truth = {pid: taken.get(pid, 0) / total for pid in work}
    recent = [values for at, values in scrapes if at > last_at - window]
    anchor = {pid: statistics.fmean(v[pid] for v in recent) for pid in work}
    return truth, shares, anchor, cpu, cycles


def _error(estimate: dict[int, float], truth: dict[int, float]) -> float:
    return max(abs(estimate.get(pid, 0.0) - value) for pid, value in truth.items())


def scenario(
    name: str, duties: list[float], seeds: int, *, every: float, window: float, scrape: float
) -> Result:
    share_errors, anchor_errors = [], []
    cpu, cycles = 0.0, 0
    shown: tuple[dict[int, float], dict[int, float], dict[int, float]] | None = None
    for seed in range(seeds):
        truth, share, anchor, spent, ran = one_run(
            duties, seed, every=every, window=window, scrape=scrape
        )
        share_errors.append(_error(share, truth))
        anchor_errors.append(_error(anchor, truth))
        cpu += spent
        cycles += ran
        shown = shown or (truth, share, anchor)
    assert shown is not None

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    per_cycle_ms = 1000 * cpu / cycles
    reads_ms_per_s = call_cost_ms("nvmlDeviceGetProcessUtilization", len(duties)) / every
    node = 8 * (reads_ms_per_s + per_cycle_ms / CYCLE) / 1000 * 100
    return Result(
        name,
        len(duties),
        pct(share_errors, 0.5),
        pct(share_errors, 0.95),
        pct(anchor_errors, 0.5),
        pct(anchor_errors, 0.95),
        *(dict(list(d.items())[:3]) for d in shown),
        per_cycle_ms,
        node,
    )


def _row(r: Result) -> str:
    first = list(r.truth)[:3]

    def three(d: dict[int, float]) -> str:
        return "/".join(f"{100 * d.get(pid, 0):.0f}" for pid in first)

    return (
        f"| {r.scenario} | {three(r.truth)} | {three(r.share)} | {three(r.anchor)} "
        f"| {100 * r.share_error_p50:.1f} / {100 * r.share_error_p95:.1f} "
        f"| {100 * r.anchor_error_p50:.1f} / {100 * r.anchor_error_p95:.1f} "
        f"| {r.tracker_ms_per_cycle:.2f} | {r.node_core_percent:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--every", type=float, default=2.0, help="--share-read-every")
    parser.add_argument("--window", type=float, default=300.0, help="--share-window")
    parser.add_argument("--scrape", type=float, default=30.0, help="the anchors' scrape")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    results = [
        scenario(
            name,
            SCENARIOS[name],
            args.seeds,
            every=args.every,
            window=args.window,
            scrape=args.scrape,
        )
        for name in args.scenarios.split(",")
    ]
    print(
        f"share read every {args.every} s, window {args.window:.0f} s, {args.seeds} seeds; "
        "the first three tenants' shares in % (truth / gpuusage / anchors); errors in points, "
        "the largest over a scenario's tenants, median / 95th percentile"
    )
    print(
        "| scenario | truth | gpuusage | anchors | gpuusage error | anchors error "
        "| tracker ms/cycle | 8 GPUs, % of a core |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(_row(r))
    if args.output:
        args.output.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
