"""A CUDA tenant for the real-GPU suite, through the driver API alone (no PyTorch): a context,
an allocation, and for a busy tenant a memset loop.

    python -m tests.gpu.tenant --mib 256 [--busy 1.0] [--cgroup DIR] [--device 0] [--count F]

It moves itself into --cgroup first (as a container's process starts in its cgroup), then
prints `ready <pid>` once its memory is allocated, and runs until killed or its standard input
closes. --busy is the share of each second it keeps the GPU at work (0: idle). With --count,
it writes to F, twice a second, how many memsets it has done and when (monotonic seconds): its
work is a fixed memset of its whole allocation, so alone and beside others the counts tell what
share of the GPU's time it got.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from pathlib import Path

MIB = 1024 * 1024


class CudaError(RuntimeError):
    """A CUDA driver API call failed."""


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    return cuda


def _check(result: int, call: str) -> None:
    if result != 0:
        raise CudaError(f"{call} failed with CUDA error {result}")


def join_cgroup(directory: Path) -> None:
    """Move this process into `directory` (cgroup v1 or v2: its cgroup.procs)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.procs").write_text(str(os.getpid()))


def run(mib: int, busy: float, device: int, count: Path | None = None) -> None:
    cuda = _driver()
    _check(cuda.cuInit(0), "cuInit")
    handle = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    context = ctypes.c_void_p()
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
    _check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    pointer = ctypes.c_uint64()
    size = max(mib, 1) * MIB
    _check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), size), "cuMemAlloc_v2")
    _check(cuda.cuMemsetD8_v2(pointer.value, 0, size), "cuMemsetD8_v2")
    _check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    print(f"ready {os.getpid()}", flush=True)
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    value = 0
    done = 0
    told = time.monotonic()

    def tell() -> None:
        if count is not None:
            partial = count.with_suffix(".partial")
            partial.write_text(f"{done} {time.monotonic()}\n")
            partial.replace(count)

    tell()
    while not stop.is_set():
        if busy <= 0:
            stop.wait(1.0)
            continue
        second = time.monotonic()
        while time.monotonic() - second < busy and not stop.is_set():
            value = (value + 1) % 256
            _check(cuda.cuMemsetD8_v2(pointer.value, value, size), "cuMemsetD8_v2")
            _check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
            done += 1
            if time.monotonic() - told >= 0.5:
                told = time.monotonic()
                tell()
        stop.wait(max(0.0, 1.0 - (time.monotonic() - second)))
        tell()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--busy", type=float, default=0.0)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--cgroup", type=Path)
    parser.add_argument("--count", type=Path)
    args = parser.parse_args()
    if args.cgroup is not None:
        join_cgroup(args.cgroup)
    run(args.mib, args.busy, args.device, args.count)


if __name__ == "__main__":
    main()
