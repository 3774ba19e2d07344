"""Which of the driver's device files a process holds through NVML, and whether shutting NVML
down lets go of them all: what a driver upgrade needs of the agent (the GPU Operator's driver
container cannot unload the kernel modules while any process holds /dev/nvidia*).

Run on a GPU machine: `python3 benchmarks/nvml_device_files.py [--output F]`. It opens NVML,
makes the agent's calls (handles, memory, process lists, utilization), and at each step lists
the process's open files and memory mappings under /dev/nvidia*; then nvmlShutdown, and the
same again; then a second init/shutdown round (the agent comes back when the driver does).
Where no driver is found it says so and writes what it could.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def held() -> dict[str, list[str]]:
    """The /dev/nvidia* files this process has open (by fd) and mapped."""
    fds = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            fds.append(target)
    maps = sorted(
        {
            line.split()[-1]
            for line in Path("/proc/self/maps").read_text().splitlines()
            if line.split()[-1].startswith("/dev/nvidia")
        }
    )
    return {"open": fds, "mapped": maps}


def exercise(pynvml: Any) -> dict[str, Any]:
    """The agent's calls on every GPU."""
    seen: dict[str, Any] = {"gpus": []}
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        entry = {"uuid": pynvml.nvmlDeviceGetUUID(handle)}
        entry["memoryUsedMiB"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used // 2**20
        entry["processes"] = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        try:
            entry["samples"] = len(pynvml.nvmlDeviceGetProcessUtilization(handle, 0))
        except pynvml.NVMLError as exc:
            entry["samples"] = str(exc)
        try:
            entry["migMode"] = list(pynvml.nvmlDeviceGetMigMode(handle))
        except pynvml.NVMLError as exc:
            entry["migMode"] = str(exc)
        seen["gpus"].append(entry)
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    steps: list[dict[str, Any]] = [{"step": "before nvmlInit", **held()}]
    try:
        import pynvml  # noqa: PLC0415

        pynvml.nvmlInit()
    except Exception as exc:
        steps.append({"step": "nvmlInit failed", "error": str(exc)})
        return finish(steps, args.output, 1)
    steps.append(
        {"step": "after nvmlInit", "driver": pynvml.nvmlSystemGetDriverVersion(), **held()}
    )
    steps.append({"step": "after the agent's calls", **exercise(pynvml), **held()})
    pynvml.nvmlShutdown()
    steps.append({"step": "after nvmlShutdown", **held()})
    pynvml.nvmlInit()
    exercise(pynvml)
    steps.append({"step": "after a second nvmlInit and the calls", **held()})
    pynvml.nvmlShutdown()
    steps.append({"step": "after the second nvmlShutdown", **held()})
    return finish(steps, args.output, 0)


def finish(steps: list[dict[str, Any]], output: Path | None, status: int) -> int:
    text = json.dumps({"steps": steps}, indent=1)
    print(text)
    if output is not None:
        output.write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
