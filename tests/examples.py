"""A realistic example report for the tests.

Two A100s: one shared by two pods (time-slicing) plus a host process, one in MIG mode with a
pod on a 3g.40gb slice. The UUIDs and sizes follow what NVML reports on such machines.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpuusage.api import names
from gpuusage.api.models import Gpu, GpuNodeUsageSpec, Memory, MigDevice, Process, Source

POD_TRAIN = "6f1c0e6a-9d4b-4c3e-8f7a-2b5d9e1c3a70"
POD_NOTEBOOK = "0b7e2f4d-1a3c-4e5f-9a8b-7c6d5e4f3a21"
POD_INFER = "d3a9b8c7-6e5f-4a3b-9c2d-1e0f9a8b7c6d"
CTR_TRAIN = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00998877665544332211"
CTR_NOTEBOOK = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90"
CTR_INFER = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d"


def empty_report(node: str, observed_at: str = "2026-11-24T12:00:00Z") -> dict[str, Any]:
    """The smallest valid GpuNodeUsage an agent could write: a node with no GPU in use."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": node},
        "spec": {
            "nodeName": node,
            "observedAt": observed_at,
            "gpus": [],
            "source": {"kind": "fake", "available": True},
        },
    }


def example_spec(node_name: str, observed_at: datetime) -> GpuNodeUsageSpec:
    """A two-GPU node report with pods, a host process and a MIG device."""
    return GpuNodeUsageSpec(
        node_name=node_name,
        observed_at=observed_at,
        source=Source(kind="fake", available=True, driver_version="550.54.15"),
        gpus=[
            Gpu(
                index=0,
                uuid="GPU-11111111-2222-3333-4444-555555555555",
                name="NVIDIA A100-SXM4-80GB",
                memory=Memory(total_mib=81920, used_mib=41472),
                processes=[
                    Process(
                        pid=4242,
                        name="python",
                        used_memory_mib=30720,
                        container_id=CTR_TRAIN,
                        pod_uid=POD_TRAIN,
                        types=["compute"],
                    ),
                    Process(
                        pid=5151,
                        name="jupyter-kernel",
                        used_memory_mib=10240,
                        container_id=CTR_NOTEBOOK,
                        pod_uid=POD_NOTEBOOK,
                        types=["compute"],
                    ),
                    Process(pid=777, name="Xorg", used_memory_mib=512, types=["graphics"]),
                ],
            ),
            Gpu(
                index=1,
                uuid="GPU-66666666-7777-8888-9999-000000000000",
                name="NVIDIA A100-SXM4-80GB",
                memory=Memory(total_mib=81920, used_mib=20480),
                mig_enabled=True,
                mig_devices=[
                    MigDevice(
                        index=0,
                        uuid="MIG-4f1d2c3b-5a6e-4d7c-8b9a-0f1e2d3c4b5a",
                        name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                        gpu_instance_id=1,
                        compute_instance_id=0,
                        memory=Memory(total_mib=40192, used_mib=20480),
                        processes=[
                            Process(
                                pid=6262,
                                name="tritonserver",
                                used_memory_mib=20480,
                                container_id=CTR_INFER,
                                pod_uid=POD_INFER,
                                types=["compute"],
                            )
                        ],
                    )
                ],
            ),
        ],
    )
