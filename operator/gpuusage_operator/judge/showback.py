"""What each running pod on a node was handed, counted as what it is. Pure.

Showback (which team holds how much GPU, for how long) needs what pods were given beside what
they use. Counting every device a pod holds as a whole GPU, as request-based tools do,
overcharges MIG slices and fractional shares; here a whole GPU, a MIG slice and a scheduler's
share are counted apart:

* whole GPUs: device-plugin GPU resources other than MIG, and the whole GPUs DRA claims got;
* MIG slices: `nvidia.com/mig-*` resources, and the MIG devices claims got (also one created
  at prepare time, known by parent and profile);
* a share: the fraction of one GPU and the GPU memory a fractional scheduler's annotations
  give, where they say it in numbers, and the device plugin's time-slicing replicas a pod
  holds where the kubelet tells of how many a GPU is advertised as (one of four: a quarter);
  replicas of a GPU whose count is not known stay whole GPUs, as the request counts them;
* a part of a device several DRA claims share (`allowMultipleAllocations`): the share of its
  time and the GPU memory its claim consumed (see allocation.consumed_part), counted as a
  share; a part of which nothing is known stays a whole GPU, as a replica does.

A GPU resource a DRA driver serves (an extended-resource claim) is counted once, as the claim's
devices: it is no device-plugin request (see index.pods).

The devices the kubelet lists for a device-plugin request are the devices its count stands
for: they are not added to it, but they tell which of them are MIG slices (a device plugin
in NVIDIA's "single" MIG strategy hands slices out as `nvidia.com/gpu`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuusage.api.models import MAX_ALLOCATIONS, MAX_MIB, MAX_SHARE, PodAllocation
from gpuusage_operator.index.pods import PodSnapshot
from gpuusage_operator.judge.allocation import Allocation
from gpuusage_operator.judge.requests import share_of


def pod_allocation(pod: PodSnapshot, allocation: Allocation) -> PodAllocation | None:
    """What the pod was handed; None when nothing (in numbers)."""
    # A part of a device several claims share is counted as its part where one is known.
    parts = [d for d in allocation.devices if d.partial and (d.share or d.memory_mib)]
    claimed = [d for d in allocation.devices if d.from_claim and d not in parts]
    listed = [d for d in allocation.devices if not d.from_claim]
    # The kubelet's devices show MIG slices a device plugin hands out as nvidia.com/gpu (its
    # "single" MIG strategy); without them the resource names say which are slices.
    plugin_mig = sum(d.is_mig for d in listed) if listed else pod.mig_requests
    replicas = [d for d in listed if d.replicas and not d.is_mig]  # counted: their share known
    requested = pod.gpu_requests - plugin_mig - sum(d.replicas for d in replicas)
    gpus = max(0, requested) + sum(not d.is_mig for d in claimed)
    mig = plugin_mig + sum(d.is_mig for d in claimed)
    share = share_of(pod.fraction)
    shares = [*replicas, *parts]
    gpu_share = round((share.gpu or 0.0) + sum(d.share or 0.0 for d in shares), 4) or None
    memory = (share.memory_mib or 0) + sum(d.memory_mib or 0 for d in parts)
    if not (gpus or mig or gpu_share or memory):
        return None
    return PodAllocation(
        namespace=pod.namespace,
        name=pod.name,
        uid=pod.uid,
        gpus=gpus,
        mig_devices=mig,
        gpu_share=min(gpu_share, MAX_SHARE) if gpu_share else None,
        gpu_memory_share_mib=min(memory, MAX_MIB) or None,
    )


def pod_allocations(
    candidates: Iterable[PodSnapshot], allocated: Callable[[PodSnapshot], Allocation]
) -> tuple[list[PodAllocation], int | None]:
    """The candidates' allocations, sorted, at most MAX_ALLOCATIONS; and how many more there
    were (None: none left out)."""
    found = [
        entry for pod in candidates if (entry := pod_allocation(pod, allocated(pod))) is not None
    ]
    found.sort(key=lambda a: (a.namespace, a.name, a.uid))
    omitted = len(found) - MAX_ALLOCATIONS
    return found[:MAX_ALLOCATIONS], omitted if omitted > 0 else None
