"""What the real driver was measured to do: the figures the agent's rules and its driver model
stand on, in one place, each with where it was measured.

Measured with NVIDIA driver 580.159.04 (open kernel module) on an H200 and an H100 80GB HBM3,
with real CUDA tenants (docs/real-driver.md has the runs). A rule that depends on one of these
says so and takes the figure from here, so a later measurement changes it in one place.
"""

from __future__ import annotations

CONTEXT_MIB = 5.8
"""Device memory the driver keeps per CUDA context that no process is charged with (its channel
buffers, held by internal clients the per-process count skips): total - free - reserved - the
listed processes' memory was 47, 94, 187, 372 and 559 MiB at 8, 16, 32, 64 and 96 contexts, on
both cards (a property of the driver, not of the card's size)."""

CONTEXT_ALLOWANCE_MIB = 8
"""What the visibility rule allows per listed context: the measured CONTEXT_MIB with a third
more for other drivers and allocator rounding (see visibility)."""

SAMPLES_PER_SECOND = 5.0
"""The per-process utilization sampler's rate: about 5 samples a second (72 samples covered
12.6 to 14.4 s), each naming the one process active on the engine at that instant."""

SAMPLES_PER_SECOND_COUNTED = 4.0
"""The rate the idle rule counts with: a fifth under the measured one, so that a driver that
samples a little slower never makes the rule believe in samples that were not taken."""

SAMPLE_RING = 72
"""Samples the driver keeps (NV2080_CTRL_PERF_GPUMON_SAMPLE_COUNT_PERFMON_UTIL): read less
often than the ring lasts and the oldest are gone."""

SAMPLE_READ_EVERY = 10.0
"""Seconds between two reads of the sampler at most, whatever the agent's --interval: 50
samples at the measured rate, 57 at the fastest seen, inside the ring of 72. At the default
--interval (10 s) the cycles' own reads are enough; a longer interval adds reads between
cycles (each costs what a cycle's sampler read does)."""

RING_LASTS = 12.0
"""Seconds after which samples may have left the ring (72 samples at 6 a second, above the
fastest rate seen): a read that comes later than that cannot tell what it missed."""

CALL_COST_MS: dict[str, tuple[float, float]] = {
    # NVML call: (ms per call with 5 processes on the device, with 64), wall ≈ CPU.
    "nvmlDeviceGetProcessUtilization": (1.7, 3.7),
    "process_list": (0.06, 0.55),  # each of compute, graphics, MPS
    "nvmlDeviceGetMigMode": (0.7, 0.7),
    "nvmlDeviceGetMemoryInfo": (0.007, 0.007),
    "nvmlDeviceGetUUID": (0.002, 0.002),
}
"""What each call cost on the real driver (one GPU, H200): the agent benchmark's driver model
charges them, so its figures describe the driver rather than a free fake."""


def call_cost_ms(call: str, processes: int) -> float:
    """A call's measured cost at `processes` processes on the device, between the two measured
    points (and flat beyond them)."""
    low, high = CALL_COST_MS[call]
    share = min(max((processes - 5) / (64 - 5), 0.0), 1.0)
    return low + (high - low) * share
