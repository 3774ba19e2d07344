"""The oldest Kubernetes gpuusage runs on, and the refusal a cluster older than that gets.

The floor is the oldest minor that the project's compatibility run passes (`make test-compat`,
docs/development.md): gpuusage's judgements of allocation lean on what the apiserver, the
scheduler and the kubelet of each minor serve (DRA's `v1`, the PodResources API's DRA devices,
the pod's extended-resource claim), and on a minor that run does not cover nothing proves
them. The chart's `kubeVersion` and docs/install.md name the same floor
(tests/test_supported_versions.py). An operator who accepts that can run on an older cluster
all the same, with `--allow-old-kubernetes`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from gpuusage.errors import GpuusageError

FLOOR = (1, 35)
"""(major, minor): the oldest supported Kubernetes."""
FLOOR_TEXT = f"{FLOOR[0]}.{FLOOR[1]}"

log = logging.getLogger(__name__)


class UnsupportedKubernetes(GpuusageError):
    """The cluster is older than FLOOR."""


def parse(version: dict[str, Any]) -> tuple[int, int] | None:
    """(major, minor) from the apiserver's /version answer; managed services write the minor
    with a suffix ("30+" on EKS and GKE), and gitVersion ("v1.35.4-gke.100") says it too.
    None where neither can be read."""
    for text in (
        f"{version.get('major', '')}.{version.get('minor', '')}",
        version.get("gitVersion"),
    ):
        match = re.match(r"^v?(\d+)\.(\d+)", str(text or ""))
        if match:
            return int(match[1]), int(match[2])
    return None


def refusal(version: dict[str, Any], *, allow_old: bool) -> str | None:
    """Why gpuusage will not run on this cluster, or None. A version that cannot be read is no
    reason to refuse (it is logged by the caller's check)."""
    found = parse(version)
    if found is None or found >= FLOOR or allow_old:
        return None
    shown = version.get("gitVersion") or f"{found[0]}.{found[1]}"
    return (
        f"this cluster runs Kubernetes {shown}; gpuusage supports {FLOOR_TEXT} and later, the "
        "minors its compatibility tests pass (older minors are past their end of life and "
        "nothing proves how gpuusage judges their allocations). Upgrade the cluster, or run "
        "with --allow-old-kubernetes to accept that."
    )


def check_server(read_version: Callable[[], Any], *, allow_old: bool) -> None:
    """Ask the apiserver its version (`read_version`: GET /version, which every identity may
    read) and raise UnsupportedKubernetes when it is below the floor; an unanswered question is
    logged and let pass, so an apiserver that is away at start does not stop the program."""
    try:
        version = read_version()
    except Exception as exc:
        log.warning("could not read the cluster's Kubernetes version (%s); not checked", exc)
        return
    if not isinstance(version, dict):
        return
    why = refusal(version, allow_old=allow_old)
    if why is not None:
        raise UnsupportedKubernetes(why)
    log.info(
        "Kubernetes %s (gpuusage supports %s and later)", version.get("gitVersion"), FLOOR_TEXT
    )
