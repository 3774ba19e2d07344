"""The pod annotation gpuusage.io/usage as readers take it: what each container of the pod uses
on each device, as the operator last wrote it (judge.podstate.usage_json writes it).

`gpuusage top` and `ps` read it for a user who may read the pods of a namespace but not the
cluster-scoped reports. A tenant may edit the annotations of their own pods, so a value that is
not the operator's shape is refused as a whole (None), never half believed.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuusage.api.models import MAX_MIB, MAX_PID, MAX_REQUESTED_GPUS


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class DeviceUse(_Part):
    """One container's use of one device."""

    uuid: str = Field(min_length=1)
    mib: int = Field(default=0, ge=0, le=MAX_MIB)
    pids: tuple[int, ...] | None = None
    """Its processes' host pids; None where the operator left them out (truncated)."""
    share: float | None = Field(default=None, ge=0)
    """Its processes' share of the device's time, where the agent measured one."""


class ContainerUse(_Part):
    name: str
    devices: tuple[DeviceUse, ...] = ()


class Usage(_Part):
    """The whole annotation."""

    node: str | None = None
    observed_at: str | None = Field(default=None, alias="observedAt")
    containers: tuple[ContainerUse, ...] = ()
    requested_gpus: int = Field(default=0, ge=0, le=MAX_REQUESTED_GPUS, alias="requestedGPUs")
    """The pod's device-plugin GPU requests, as the operator counts them."""
    truncated: bool = False
    """The operator shortened it (pids dropped, then containers from the end): a part only."""

    def processes(self) -> int | None:
        """How many processes it lists; None where pids were left out."""
        if any(d.pids is None for c in self.containers for d in c.devices):
            return None
        return sum(len(d.pids or ()) for c in self.containers for d in c.devices)


def decode_usage(text: str | None) -> Usage | None:
    """The usage an annotation holds; None when absent or not of the operator's shape."""
    if not text:
        return None
    try:
        usage = Usage.model_validate_json(text)
    except ValidationError:
        return None
    pids = (p for c in usage.containers for d in c.devices for p in d.pids or ())
    if any(not 0 < pid <= MAX_PID for pid in pids):
        return None
    return usage
