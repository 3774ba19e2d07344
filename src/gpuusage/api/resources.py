"""Which device-plugin resources are GPUs, and what a device plugin's device ID names. Pure.

One copy shared by the agent (which pods' kubelet allocations it publishes) and the operator
(which requests count as a GPU allocation), so the two never disagree about a resource name.
"""

from __future__ import annotations

from collections.abc import Iterable

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
"""What NVIDIA's device plugin calls a GPU's time-slicing (or MPS) replicas with
`renameByDefault`; a MIG device's are `nvidia.com/mig-<profile>.shared`."""
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
REPLICA_SEPARATOR = "::"
"""NVIDIA's device plugin names a time-sliced replica `<UUID>::<n>`."""


def is_gpu_resource(name: str, extra: Iterable[str] = ()) -> bool:
    """`nvidia.com/gpu`, `nvidia.com/mig-<profile>`, their `.shared` replicas (NVIDIA's plugin
    with `renameByDefault`), or a configured extra name (Volcano's vGPU count, a vendor's
    variant)."""
    return (
        name in (GPU_RESOURCE, SHARED_GPU_RESOURCE)
        or name.startswith(MIG_RESOURCE_PREFIX)
        or name in extra
    )


def device_of(device_id: str) -> str:
    """The device a device plugin's ID stands for: time-sliced replicas share their GPU's."""
    return device_id.split(REPLICA_SEPARATOR, 1)[0]


def mig_profile(name: str | None) -> str | None:
    """The profile in a MIG device's product name: "NVIDIA A100-SXM4-40GB MIG 1g.5gb" → "1g.5gb"."""
    if not name or " MIG " not in name:
        return None
    return name.rsplit(" MIG ", 1)[1].strip() or None
