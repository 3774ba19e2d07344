"""Does a device's process list explain its memory? Pure.

NVML can answer and still not list every process on a device: the open GPU kernel modules
(NVIDIA's default for Turing and newer since R560) translate pids into the caller's pid
namespace and drop the ones they cannot map; a container runtime can hide pids; on MIG, listing
other GPU instances' processes needs the monitor capability. The device then shows memory in use
and lists fewer processes, or none. Taking that list as the truth would call pods "ended" and
"idle" while they compute.

So the agent compares what the driver counts with what the list explains: memory in use, less
the driver's reserved part, less what the listed processes hold, beyond an allowance. The
driver keeps memory of its own for every CUDA context that no process is charged with (about
5.8 MiB a context, measured: see driverfacts), so a GPU shared by many processes shows hundreds
of MiB no process explains while every one of them is listed (559 MiB at 96 contexts). The
allowance therefore grows with the contexts the device lists: `base_mib` (allocator jitter
between the reads; gpusource.nvml reads memory around the lists and keeps the lower figure)
plus `per_context_mib` for each listed process. More than that makes the device blind: it keeps
its listed processes, and its `error` says `ProcessesNotVisible`, which the operator turns into
`Unknown` for the pods that were on it, never into "ended" or "idle".

What the rule can see: a device that lists none of its processes (an agent outside the host's
pid namespace on the open kernel module), and a hidden process holding more than the base plus
the margin per context (8 - 5.8 MiB) times the contexts: at 64 listed contexts, anything from
about 400 MiB, so a hidden process of 1 GiB or more is always seen. What it cannot see: a hidden
process holding less than that, and a hidden process on a device whose listed processes' memory
is not told (nothing is weighed there).

Where the driver does not tell the reserved part (drivers older than R510, the memory call v1),
up to RESERVED_UNTOLD of the device's memory is taken as reserved (conservative: a few hundred
MiB on current GPUs; more unexplained memory than that is still seen). Where a listed process's
memory is not told (usedGpuMemory not available), the list cannot be weighed: nothing is judged.
A MIG-enabled GPU's own memory is the sum of its slices and it lists no process: each MIG device
is weighed on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuusage.api.models import MAX_DETAIL, DeviceError, Gpu, Memory, MigDevice, safe_text
from gpuusage_nodeagent.driverfacts import CONTEXT_ALLOWANCE_MIB
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading

DEFAULT_ALLOWANCE_MIB = 256
RESERVED_UNTOLD = 0.02
"""Share of a device's memory taken as the driver's where it does not say (see above)."""
REASON = "ProcessesNotVisible"
PID_HINT = " (pids outside the agent's pid namespace? it needs hostPID)"
MIG_HINT = (
    "; listing other MIG instances' processes needs the monitor capability "
    "(NVIDIA_MIG_MONITOR_DEVICES=all)"
)


def unexplained_mib(memory: Memory | None, processes: Sequence[RawProcess]) -> int | None:
    """Memory in use that neither the driver's reserved part nor the listed processes explain;
    None where that cannot be weighed (memory unknown, a process's memory not told)."""
    if memory is None or memory.used_mib is None:
        return None
    if any(p.used_memory_mib is None for p in processes):
        return None
    reserved = memory.reserved_mib
    if reserved is None:
        reserved = int(memory.total_mib * RESERVED_UNTOLD)
    listed = sum(p.used_memory_mib or 0 for p in processes)
    return max(memory.used_mib - reserved - listed, 0)


@dataclass(frozen=True)
class Allowance:
    """Memory in use that no listed process explains and still no sign of a hidden one."""

    base_mib: int = DEFAULT_ALLOWANCE_MIB
    per_context_mib: int = CONTEXT_ALLOWANCE_MIB

    def for_contexts(self, contexts: int) -> int:
        """The allowance on a device that lists `contexts` processes."""
        return self.base_mib + self.per_context_mib * contexts


def blindness(
    device: Gpu | MigDevice, processes: Sequence[RawProcess], allowance: Allowance
) -> DeviceError | None:
    """The error that says a device's list does not explain its memory, or None."""
    missing = unexplained_mib(device.memory, processes)
    allowed = allowance.for_contexts(len(processes))
    if missing is None or missing <= allowed:
        return None
    what = "that its listed processes do not hold" if processes else "but no process listed"
    message = (
        f"{missing} MiB in use {what} (beyond the driver's reserved part and the {allowed} MiB "
        f"allowed for its bookkeeping of {len(processes)} contexts): "
        "NVML does not list every process"
    )
    message += MIG_HINT if isinstance(device, MigDevice) else PID_HINT
    return DeviceError(reason=REASON, message=safe_text(message, MAX_DETAIL))


def with_blind_devices(reading: Reading, allowance: Allowance | None = None) -> Reading:
    """The reading with every device whose list does not explain its memory marked blind.
    Devices with an error already (nothing was listed) are left as they are."""
    allowance = allowance or Allowance()
    changed = False
    gpus: list[Gpu] = []
    for gpu in reading.gpus:
        update: dict[str, object] = {}
        if gpu.error is None and not gpu.mig_enabled:
            error = blindness(gpu, reading.processes_of(gpu), allowance)
            if error is not None:
                update["error"] = error
        migs = []
        for mig in gpu.mig_devices:
            error = None
            if mig.error is None and gpu.error is None:
                error = blindness(mig, reading.processes_of(mig), allowance)
            migs.append(mig if error is None else mig.model_copy(update={"error": error}))
        if any(m is not o for m, o in zip(migs, gpu.mig_devices, strict=True)):
            update["mig_devices"] = migs
        changed = changed or bool(update)
        gpus.append(gpu.model_copy(update=update) if update else gpu)
    if not changed:
        return reading
    return replace(reading, gpus=gpus)
