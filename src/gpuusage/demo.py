"""`gpuusage demo`: the product on a local control plane, without a GPU or a cluster.

This version shows the API: it starts the local control plane, installs the CRD, publishes an
example node report, records its totals through the status subresource, and prints what
`kubectl get gpunodeusage` shows. The agent and the operator join it as they arrive.
"""

from __future__ import annotations

import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client

from gpuusage.api import names
from gpuusage.api.models import GpuNodeUsageSpec, GpuNodeUsageStatus
from gpuusage.api.summary import all_processes, totals
from gpuusage.examples import example_spec
from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crd
from gpuusage.localcluster.cluster import LocalCluster
from gpuusage.operator.freshness import stale_condition

DEMO_NODE = "gpu-node-a"


def _step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def spec_only_status(spec: GpuNodeUsageSpec, now: datetime) -> GpuNodeUsageStatus:
    """Status computed from the spec alone: pods are counted by the pod UIDs the agent saw."""
    listed = list(all_processes(spec))
    pods = {p.pod_uid for _, p in listed if p.pod_uid}
    outside = sum(1 for _, p in listed if not p.pod_uid)
    stale = stale_condition(spec.observed_at, now)
    return GpuNodeUsageStatus(
        totals=totals(spec, pods=len(pods), unattributed=outside), conditions=[stale]
    )


def run_demo(directory: Path | None, keep: bool = False) -> int:
    workdir = directory or Path(tempfile.mkdtemp(prefix="gpuusage-demo-"))
    cluster = LocalCluster(workdir)
    _step(f"starting a local control plane in {workdir} (etcd + kube-apiserver on loopback)")
    cluster.up()
    try:
        api, _ = api_client(cluster.kubeconfig)
        with api:
            _step("installing the GpuNodeUsage CRD")
            install_crd(api)
            custom = client.CustomObjectsApi(api)
            now = datetime.now(UTC)
            spec = example_spec(DEMO_NODE, now)
            _step(f"publishing the report of node {DEMO_NODE} (2 GPUs, 4 processes, 1 MIG slice)")
            custom.create_cluster_custom_object(
                names.GROUP,
                names.VERSION,
                names.PLURAL,
                {
                    "apiVersion": names.API_VERSION,
                    "kind": names.KIND,
                    "metadata": {"name": DEMO_NODE},
                    "spec": spec.to_api(),
                },
            )
            status = spec_only_status(spec, now)
            custom.patch_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.PLURAL, DEMO_NODE, {"status": status.to_api()}
            )
        kubectl = [str(cluster.binaries.kubectl), f"--kubeconfig={cluster.kubeconfig}"]
        _step("kubectl get gpunodeusage -o wide")
        subprocess.run([*kubectl, "get", "gpunodeusage", "-o", "wide"], check=True)
    finally:
        if keep:
            print(f"\ncluster left running; export KUBECONFIG={cluster.kubeconfig}")
            print(f"stop it with: gpuusage local-cluster down --dir {workdir}")
        else:
            _step("stopping the local control plane")
            cluster.down()
    return 0
