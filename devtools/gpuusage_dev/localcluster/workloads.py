"""What runs on the real node as a GPU workload: busybox (asleep, or running a given command),
asking for whole GPUs. The tests, the demo and the benchmarks put its real pid on a GPU through
the scenario file."""

from __future__ import annotations

from typing import Any

BUSYBOX = "gpuusage.local/busybox:1"
"""Imported into the node's containerd by hand (images): nothing is pulled."""


def busybox(command: list[str], gpus: int) -> dict[str, Any]:
    """The container: `gpus` whole GPUs in its limits; at 0 no request at all, as a pod that
    never asked for a GPU is written."""
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX,
        "imagePullPolicy": "Never",
        "command": command,
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return container


def sleeper(gpus: int, seconds: int = 3600) -> dict[str, Any]:
    return busybox(["/bin/sleep", str(seconds)], gpus)


def pod_spec(container: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A pod of one container that ends at once when deleted."""
    return {"terminationGracePeriodSeconds": 1, "containers": [container], **more}


def template(app: str, container: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A controller's pod template, labelled app=`app`."""
    return {"metadata": {"labels": {"app": app}}, "spec": pod_spec(container, **more)}


def sleeper_pod(namespace: str, name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": pod_spec(sleeper(gpus)),
    }


def sleeper_deployment(name: str, namespace: str, gpus: int, seconds: int = 3600) -> dict[str, Any]:
    """One replica, labelled app=`name`."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": template(name, sleeper(gpus, seconds)),
        },
    }


def gpu_job(name: str, namespace: str, command: list[str], gpus: int = 1) -> dict[str, Any]:
    """A Job of one busybox pod running `command` (restartPolicy Never, no retries), labelled
    app=`name`."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "backoffLimit": 0,
            "template": template(name, busybox(command, gpus), restartPolicy="Never"),
        },
    }
