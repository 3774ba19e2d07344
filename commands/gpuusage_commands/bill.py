"""The bill of use over a window: per namespace, GPU-hours handed, held and computing, compute
hours (each pod's measured share of its GPUs' time), and GPU memory GiB-hours, from
Prometheus. Pure: the queries, and the reading of their answers.

The reports hold what is true now; hours need history, which Prometheus keeps as the
`gpuusage-showback` recording rules (evaluated every minute). A window's hours are the sum of
the per-minute values over it divided by 60, as the rules file's own `:sum1h` rules and the
Namespace dashboard compute them, so all three agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuusage.errors import GpuusageError

WINDOW = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?$")
"""A window as Prometheus and kubectl write one: 7d, 24h, 90m, 1h30m."""

RULES = {
    "handed": ("namespace:gpuusage_gpus_allocated:sum", 60),
    "held": ("namespace:gpuusage_gpus_used:count", 60),
    "computing": ("namespace:gpuusage_gpus_computing:count", 60),
    "compute": ("namespace:gpuusage_gpu_compute_share:sum", 60),
    "untold": ("namespace:gpuusage_gpus_share_untold:count", 60),
    "memory": ("namespace:gpuusage_gpu_memory_used_mib:sum", 60 * 1024),
}
"""What each column sums (the showback rule) and what turns its per-minute sum into hours (and
MiB into GiB)."""


class BillError(GpuusageError):
    """A window that is not one, or an answer that is not Prometheus'."""


def window_minutes(window: str) -> int:
    """The window's length in minutes; a clear error for anything Prometheus would refuse or
    that is shorter than the rules' one-minute step."""
    found = WINDOW.match(window)
    if not window or found is None:
        raise BillError(f"--window {window!r}: write it as Prometheus does, e.g. 90m, 24h, 7d")
    days, hours, minutes = (int(g or 0) for g in found.groups())
    total = (days * 24 + hours) * 60 + minutes
    if total < 1:
        raise BillError(f"--window {window!r}: at least one minute (the rules' step)")
    return total


def query(column: str, window: str, namespace: str | None = None) -> str:
    """The PromQL of one column over the window, per namespace (one namespace when given)."""
    rule, divisor = RULES[column]
    selector = f'{{namespace="{namespace}"}}' if namespace else ""
    return f"sum by (namespace) (sum_over_time({rule}{selector}[{window}])) / {divisor}"


def read_vector(answer: Mapping[str, Any]) -> dict[str, float]:
    """Per namespace, the value of an instant query's answer (Prometheus' HTTP API: status,
    data.resultType "vector", data.result[].metric/value)."""
    if answer.get("status") != "success":
        raise BillError(f"Prometheus refused the query: {answer.get('error') or answer}")
    data = answer.get("data") or {}
    if data.get("resultType") != "vector":
        raise BillError(f"expected a vector from Prometheus, got {data.get('resultType')!r}")
    found: dict[str, float] = {}
    for sample in data.get("result") or []:
        namespace = (sample.get("metric") or {}).get("namespace")
        value = sample.get("value") or [None, None]
        try:
            found[str(namespace)] = float(value[1])
        except (TypeError, ValueError, IndexError) as exc:
            raise BillError(f"unreadable sample in Prometheus' answer: {sample}") from exc
    return found


@dataclass(frozen=True)
class Bill:
    """One namespace's hours over the window."""

    namespace: str
    handed: float = 0.0
    held: float = 0.0
    computing: float = 0.0
    memory_gib: float = 0.0
    compute: float = 0.0
    """Compute hours: its pods' measured shares of their GPUs' time, summed over the window;
    four pods time-sliced on one GPU add up to that GPU's busy hours, never four."""
    untold: float = 0.0
    """GPU-hours its pods held memory on GPUs that tell no share (MPS clients, GPUs without
    per-process utilization): counted apart, as what they are."""

    def efficiency(self, used: float) -> float | None:
        """Used GPU-hours per GPU-hour handed; None when nothing was handed (a namespace
        using GPUs without any request has no ratio: its GPUs are all beyond its share)."""
        return used / self.handed if self.handed > 0 else None


def bills(columns: Mapping[str, Mapping[str, float]]) -> dict[str, Bill]:
    """Each namespace's bill from the columns' answers (a namespace absent from an answer had
    none of it)."""
    names = sorted({ns for found in columns.values() for ns in found})
    return {
        ns: Bill(
            ns,
            handed=columns.get("handed", {}).get(ns, 0.0),
            held=columns.get("held", {}).get(ns, 0.0),
            computing=columns.get("computing", {}).get(ns, 0.0),
            memory_gib=columns.get("memory", {}).get(ns, 0.0),
            compute=columns.get("compute", {}).get(ns, 0.0),
            untold=columns.get("untold", {}).get(ns, 0.0),
        )
        for ns in names
    }


HEADER = ["GPU-H", "HELD-H", "COMPUTING-H", "COMPUTE-H", "NO-SHARE-H", "GIB-H"]
HEADER += ["HELD/GPU-H", "COMPUTING/GPU-H"]


def _hours(value: float) -> str:
    return f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def cells(bill: Bill) -> list[str]:
    """A namespace's bill as table cells (see HEADER)."""
    return [
        _hours(bill.handed),
        _hours(bill.held),
        _hours(bill.computing),
        _hours(bill.compute),
        _hours(bill.untold),
        _hours(bill.memory_gib),
        _ratio(bill.efficiency(bill.held)),
        _ratio(bill.efficiency(bill.computing)),
    ]


def statement(window: str, at: str, source: str) -> str:
    """The line under the table that says what the hours cover."""
    return (
        f"GPU-H: GPU-hours handed to the namespace's pods; HELD-H: with memory in use; "
        f"COMPUTING-H: with an engine in use (where the device tells); COMPUTE-H: the pods' "
        f"measured shares of their GPUs' time (pods sharing a GPU add up to its busy hours); "
        f"NO-SHARE-H: held on GPUs that tell no share (MPS clients, a share not measured yet); "
        f"GIB-H: GPU memory "
        f"GiB-hours; over the {window} to {at}, whole GPUs only (MIG slices and shares are "
        f"not GPUs), from the showback rules in Prometheus at {source}"
    )
