"""The operator's settings: every flag, its environment variable, default and reason."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from gpuusage.settings import CommandSettings


class OperatorSettings(CommandSettings):
    kubeconfig: Path | None = None
    """Kubeconfig file; else $KUBECONFIG, the in-cluster service account, ~/.kube/config."""
    stale_after: float = Field(default=180.0, gt=0)
    """Seconds without a report after which a node's report is stale (three agent heartbeats)."""
    resync: float = Field(default=10.0, gt=0)
    """Seconds between checks of the reports' freshness."""
