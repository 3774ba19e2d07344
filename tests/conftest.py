"""Shared fixtures: one real local control plane per test session.

The control plane is built from Go modules on first use (cached outside the repository) and
tied to this process with PR_SET_PDEATHSIG, so even a killed test run leaves no etcd or
kube-apiserver behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpuusage.kube.config import api_client
from gpuusage.kube.crds import install_crds
from gpuusage.localcluster.cluster import LocalCluster

# Child processes (the CLI under test) must import the same gpuusage as this test run.
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def wait_for(predicate: Callable[[], Any], timeout: float = 45.0, what: str = "condition") -> Any:
    """Poll until predicate returns something truthy; an API error or a missing field
    (the object is not there yet) counts as not yet. Fails the test at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (ApiException, KeyError, IndexError, TypeError, StopIteration):
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Kubectl:
    """kubectl of the same version as the apiserver, pointed at the test cluster."""

    def __init__(self, binary: Path, kubeconfig: Path) -> None:
        self.base = [str(binary), f"--kubeconfig={kubeconfig}"]

    def run(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, input=stdin, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}")
        return proc.stdout + proc.stderr if not check else proc.stdout


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), tie_to_parent=True)
    local.up()
    try:
        api, _ = api_client(local.kubeconfig)
        with api:
            install_crds(api)
        yield local
    finally:
        local.down()


@pytest.fixture
def api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    api, _ = api_client(cluster.kubeconfig)
    with api:
        yield api


@pytest.fixture
def kubectl(cluster: LocalCluster) -> Kubectl:
    return Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
