"""Is the GPU Operator about to unload this node's driver? Pure.

The GPU Operator's upgrade controller (NVIDIA/k8s-operator-libs, pkg/upgrade/consts.go; the
operator sets the driver name "gpu" in cmd/gpu-operator/main.go) walks each node through the
states of its label `nvidia.com/gpu-driver-upgrade-state`. It evicts only the pods that ask
for GPUs (gpuPodSpecFilter: an `nvidia.com/gpu*` or `nvidia.com/mig-*` resource, or a GPU
ResourceClaim) and drains with every DaemonSet ignored, so the agent stays on the node; the new
driver pod cannot unload the kernel modules while any process holds /dev/nvidia* open, and
NVML holds them from nvmlInit to nvmlShutdown. So from the state in which the controller starts
removing the driver's users until the new driver is loaded, the agent lets go of NVML:

* `pod-deletion-required`, `drain-required`: the GPU pods are being removed; the driver goes
  next, and the agent must not be the last user left.
* `pod-restart-required`: the driver pod is restarted (or, with safe driver load, let go on):
  the old modules are unloaded now.
* `node-maintenance-required`, `post-maintenance-required`: the same steps when an external
  maintenance operator drains the node (the controller's requestor mode).

Every other value reads the GPUs: before `pod-deletion-required` (`upgrade-required`,
`cordon-required`, `wait-for-jobs-required`) the pods still run on the old driver and are
worth watching; from `validation-required` on (`uncordon-required`, `upgrade-done`) the new
driver is loaded and its validator runs on it; `upgrade-failed` says nothing about whether a
driver is loaded, which NVML itself then tells. A value this list does not know reads the GPUs
too: an unknown word never blinds the agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

UPGRADE_STATE_LABEL: Final = "nvidia.com/gpu-driver-upgrade-state"
"""The GPU Operator's node label (k8s-operator-libs: "nvidia.com/%s-driver-upgrade-state",
driver name "gpu")."""

RELEASING_STATES: Final = frozenset(
    {
        "pod-deletion-required",
        "drain-required",
        "pod-restart-required",
        "node-maintenance-required",
        "post-maintenance-required",
    }
)
"""The states in which the driver is about to be unloaded or is being replaced."""


def upgrading(labels: Mapping[str, str], label: str = UPGRADE_STATE_LABEL) -> str | None:
    """The upgrade state that asks the agent to let go of the driver, from its Node's labels;
    None when the GPUs may be read (no label, or any other state)."""
    state = labels.get(label)
    return state if state in RELEASING_STATES else None
