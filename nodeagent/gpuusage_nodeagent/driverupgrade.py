"""Is the GPU Operator about to unload this node's driver, or to reset its GPUs? Pure.

Two labels on the agent's own Node say so; either is enough, and each is read the same way by
`releasing`, the one rule for "the driver is leaving".

The upgrade controller's state. The GPU Operator's upgrade controller (NVIDIA/k8s-operator-libs,
pkg/upgrade/consts.go; the operator sets the driver name "gpu" in cmd/gpu-operator/main.go)
walks each node through the states of its label `nvidia.com/gpu-driver-upgrade-state`. It evicts
only the pods that ask for GPUs (gpuPodSpecFilter: an `nvidia.com/gpu*` or `nvidia.com/mig-*`
resource, or a GPU ResourceClaim) and drains with every DaemonSet ignored, so the agent stays on
the node; the new driver pod cannot unload the kernel modules while any process holds
/dev/nvidia* open, and NVML holds them from nvmlInit to nvmlShutdown. So from the state in which
the controller starts removing the driver's users until the new driver is loaded, the agent lets
go of NVML:

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

The GPU clients' deploy label. The GPU Operator (26.7 on) labels its GPU nodes
`nvidia.com/gpu.deploy.client=true` for GPU clients that are not its own. Whoever is about to
take the driver or the GPUs away sets it to a value with `paused-for-`: the driver manager
(NVIDIA/k8s-driver-manager, cmd/driver-manager/main.go, `maybeSetPaused`) writes
`paused-for-driver-upgrade` (appended to a value other than `true`, as `X_paused-for-...`)
before it unloads the driver, at every start of a driver pod, with or without the upgrade
controller; the MIG manager (NVIDIA/mig-parted, pkg/mig/reconfigure) writes
`paused-for-mig-change` before it changes MIG mode (a GPU reset, which no open client may
survive) or MIG devices. Both set it back (`true`) when done. So while its value holds
`paused-for-`, the agent lets go of NVML too; `true`, `false`, no label or any other value reads
the GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

UPGRADE_STATE_LABEL: Final = "nvidia.com/gpu-driver-upgrade-state"
"""The GPU Operator's node label (k8s-operator-libs: "nvidia.com/%s-driver-upgrade-state",
driver name "gpu")."""

CLIENT_DEPLOY_LABEL: Final = "nvidia.com/gpu.deploy.client"
"""The GPU Operator's node label for GPU clients that are not its own operands."""

PAUSED: Final = "paused-for-"
"""What the driver manager's and the MIG manager's paused values hold
(`paused-for-driver-upgrade`, `paused-for-mig-change`)."""

RELEASING_STATES: Final = frozenset(
    {
        "pod-deletion-required",
        "drain-required",
        "pod-restart-required",
        "node-maintenance-required",
        "post-maintenance-required",
    }
)
"""The upgrade states in which the driver is about to be unloaded or is being replaced."""


def releasing(labels: Mapping[str, str], label: str = UPGRADE_STATE_LABEL) -> str | None:
    """What on the Node asks the agent to let go of the driver, as `label=value`, from its
    labels; None when the GPUs may be read. `label` names the upgrade state's label."""
    state = labels.get(label)
    if state in RELEASING_STATES:
        return f"{label}={state}"
    client = labels.get(CLIENT_DEPLOY_LABEL, "")
    if PAUSED in client:
        return f"{CLIENT_DEPLOY_LABEL}={client}"
    return None
