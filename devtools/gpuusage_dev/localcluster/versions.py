"""The Kubernetes versions the local cluster runs: the supported minors, the default, the choice.

Each supported minor is pinned at one patch release that the Go module proxy serves; the local
cluster builds its programs of that version once and caches them by version (see binaries).
The newest is the default; `--kubernetes-version` or $GPUUSAGE_KUBERNETES_VERSION picks another.
The same list is what the docs call supported and what the chart's `kubeVersion` floor names
(`tests/test_docs.py` holds them together), and what `make test-compat` runs on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from gpuusage.errors import GpuusageError

SUPPORTED = ("v1.35.4", "v1.36.3", "v1.37.2")
"""One release per supported minor, oldest first."""
DEFAULT = SUPPORTED[-1]
OLDEST = SUPPORTED[0]
ENV = "GPUUSAGE_KUBERNETES_VERSION"


class UnsupportedVersion(GpuusageError):
    """A Kubernetes version the local cluster does not run."""


def minor(version: str) -> int:
    """The minor number of `v1.M.P`."""
    return int(version.removeprefix("v").split(".")[1])


def choose(explicit: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The version to run: `explicit`, else $GPUUSAGE_KUBERNETES_VERSION, else DEFAULT.

    `1.36`, `v1.36` and `1.36.3` all name v1.36.3; a minor or release not in SUPPORTED is
    refused with the list, never built on a guess.
    """
    wanted = (explicit or environ.get(ENV) or DEFAULT).strip()
    match = re.fullmatch(r"v?1\.(\d+)(?:\.(\d+))?", wanted)
    for version in SUPPORTED if match else ():
        assert match is not None
        if minor(version) == int(match[1]) and (
            match[2] is None or version.endswith(f".{match[2]}")
        ):
            return version
    raise UnsupportedVersion(
        f"Kubernetes {wanted!r} is not one the local cluster runs; supported: "
        f"{', '.join(SUPPORTED)} (a minor such as 1.36 names its release here)"
    )
