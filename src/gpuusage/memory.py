"""Giving memory freed after a burst back to the system.

A full list of a large cluster's pods reads megabytes of JSON; once parsed and dropped, glibc
keeps the freed pages of its heap for later use, and the process's resident memory stays at
the burst's height (benchmarks/pod_index_memory.py measured about a third of the pod index's
resident figure so). `malloc_trim(0)` hands every whole free page back. Where the C library has
no such call (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return function


def trim() -> bool:
    """Return the heap's free pages to the system; whether the C library could."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True
