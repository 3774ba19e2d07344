"""`gpuusage crd`: the CustomResourceDefinitions, rendered from the models (one source of truth)."""

from __future__ import annotations

import sys
from pathlib import Path

from gpuusage.api.crd import render_crd_yaml, render_policy_crd_yaml
from gpuusage.settings import CommandSettings


class CrdSettings(CommandSettings):
    output: Path | None = None
    """Write the CRD YAML to this file instead of standard output."""
    policy: bool = False
    """Render the GpuUsagePolicy CRD instead (what gpuusage does about what it sees)."""


def run_crd(settings: CrdSettings) -> int:
    text = render_policy_crd_yaml() if settings.policy else render_crd_yaml()
    if settings.output is None:
        sys.stdout.write(text)
    else:
        settings.output.parent.mkdir(parents=True, exist_ok=True)
        settings.output.write_text(text)
    return 0
