"""The product installed on the local node as users install it: `kubectl apply -k` of the
repository's manifests, through an overlay that changes only what a node without a GPU or a
cluster network needs.

* The GPUs are the only simulated part: the agent reads a scenario file (`--gpu-source
  fake:/scenario/gpus.yaml`, a hostPath the tests write) whose pids are real host pids of real
  pods, and resolves them through the real /proc (hostPID) as on a GPU node.
* The kubelet's root is the node's own folder: the PodResources hostPath points there (what a
  k0s or MicroK8s user changes too).
* The node runs no kube-proxy: the agent and the operator reach the apiserver on loopback
  (hostNetwork and KUBERNETES_SERVICE_HOST/PORT, as the in-cluster configuration reads them);
  everything else, the pod-bound tokens, RBAC and the admission policy included, is the
  install's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from gpuusage_dev.localcluster.productimages import REPO

SCENARIO_MOUNT = "/scenario"
ONE_REPLICA = {"op": "replace", "path": "/spec/replicas", "value": 1}


def _api_env(port: int) -> list[dict[str, Any]]:
    return [
        {"op": "add", "path": "/spec/template/spec/hostNetwork", "value": True},
        {"op": "add", "path": "/spec/template/spec/dnsPolicy", "value": "ClusterFirstWithHostNet"},
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "KUBERNETES_SERVICE_PORT", "value": str(port)},
        },
    ]


def overlay(
    directory: Path,
    *,
    apiserver_port: int,
    scenario_dir: Path,
    kubelet_root: Path,
    agent_args: tuple[str, ...] = (),
    operator_args: tuple[str, ...] = (),
    base: str = "manifests",
) -> Path:
    """Write the overlay's kustomization into `directory`; its folder, for `kubectl apply -k`.
    `agent_args`, `operator_args`: more flags (tests shorten the agent's interval, the demo
    the operator's --idle-after); `base`: the install it builds on (a folder of the
    repository: manifests/, or one of its overlays)."""
    agent = [
        *_api_env(apiserver_port),
        {
            "op": "replace",
            "path": "/spec/template/spec/containers/0/args",
            "value": ["agent", "--gpu-source", f"fake:{SCENARIO_MOUNT}/gpus.yaml", *agent_args],
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/volumeMounts/-",
            "value": {"name": "scenario", "mountPath": SCENARIO_MOUNT, "readOnly": True},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/volumes/-",
            "value": {"name": "scenario", "hostPath": {"path": str(scenario_dir)}},
        },
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes bases by relative path only
        "resources": [os.path.relpath(REPO / base, directory)],
        "patches": [
            {
                "target": {"kind": "DaemonSet", "name": "gpuusage-agent"},
                "patch": json.dumps(agent),
            },
            {
                "target": {"kind": "DaemonSet", "name": "gpuusage-agent"},
                "patch": yaml.safe_dump(
                    {
                        "apiVersion": "apps/v1",
                        "kind": "DaemonSet",
                        "metadata": {"name": "gpuusage-agent", "namespace": "gpuusage-system"},
                        "spec": {
                            "template": {
                                "spec": {
                                    "volumes": [
                                        {
                                            "name": "pod-resources",
                                            "hostPath": {
                                                "path": str(kubelet_root / "pod-resources"),
                                                "type": "Directory",
                                            },
                                        }
                                    ]
                                }
                            }
                        },
                    }
                ),
            },
            {
                "target": {"kind": "Deployment", "name": "gpuusage-operator"},
                # one replica: two on one host network would share its ports
                "patch": json.dumps(
                    [
                        *_api_env(apiserver_port),
                        {"op": "replace", "path": "/spec/replicas", "value": 1},
                        *(
                            {
                                "op": "add",
                                "path": "/spec/template/spec/containers/0/args/-",
                                "value": a,
                            }
                            for a in operator_args
                        ),
                    ]
                ),
            },
        ],
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory
