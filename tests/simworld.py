"""The simulated world make_world builds (see conftest): a node with running pods in a
namespace of its own, a fake GPU source the test writes, the node's agent and, unless asked
otherwise, a standalone operator; all in-process, against the real apiserver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from gpuusage_dev.simulation import Background
from gpuusage_operator.controller.reconcile import Reconciler
from gpuusage_operator.main import Operator


@dataclass(frozen=True)
class SimWorld:
    api: client.ApiClient
    core: client.CoreV1Api
    ns: str
    node: str
    pids: dict[str, int]
    """Pod name → the pid of its process on the node."""
    uids: dict[str, str]
    """Pod name → its UID."""
    proc: Path
    """The node's /proc, as the agent reads it."""
    scenario_file: Path
    write: Callable[..., None]
    """write(notebook=True): train on GPU0 (with Xorg), the notebook on GPU1 (or no process)."""
    scenario: Callable[[list[dict[str, Any]]], None]
    """Any other scenario: the GPUs and their processes."""
    agent: Background
    operator: Background | None = None
    built: Operator | None = None
    """The operator's parts (None: the world has no operator of its own)."""
    metrics_port: int = 0

    def stop_operator(self) -> None:
        """Stop the world's operator (as a crash or a rollout would)."""
        assert self.operator is not None, "this world runs no operator of its own"
        self.operator.halt()

    @property
    def reconciler(self) -> Reconciler:
        assert self.built is not None, "this world runs no operator of its own"
        return self.built.reconciler
