"""OpenShift's SecurityContextConstraints admission for tests, with no OpenShift cluster: the
matching code the openshift-apiserver runs (github.com/openshift/apiserver-library-go), built
from Go modules (main.go beside this file) and cached like the control plane.

`admit` answers whether an SCC admits a pod in a namespace and what security context it gives
the pod: the chart's OpenShift values are held to OpenShift's own rules (the agent to its SCC,
the operator to restricted-v2), not to a reading of them kept here.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuusage_dev.localcluster.binaries import (
    BinariesError,
    Progress,
    ensure_go_program,
    stderr_progress,
)
from gpuusage_dev.localcluster.tools import OPENSHIFT_SCC_CRDS

SOURCE = Path(__file__).with_name("main.go")
LIBRARY_MODULE = "github.com/openshift/apiserver-library-go v0.0.0-20250917015549-a8019f39f670"
"""The SCC admission of OpenShift 4.21 and 4.22 (their release branches' head)."""
API_MODULE = f"{OPENSHIFT_SCC_CRDS.module} {OPENSHIFT_SCC_CRDS.version}"
"""security.openshift.io/v1 of the SCC CRD the tests install."""
KUBERNETES = "v1.33.2"
"""The k8s.io/kubernetes the library is built against (its go.mod): its pod types and
security-context helpers, which later releases changed."""
LIBRARY_GO = (
    "github.com/openshift/library-go => "
    "github.com/openshift/library-go v0.0.0-20250127111945-0f76e23726cd"
)
"""The library asks for a library-go the module proxy does not serve; it uses one package of
it (the namespace's uid-range annotation), the same in this earlier version."""

NAMESPACE_RANGES = {
    "openshift.io/sa.scc.uid-range": "1000680000/10000",
    "openshift.io/sa.scc.supplemental-groups": "1000680000/10000",
    "openshift.io/sa.scc.mcs": "s0:c26,c15",
}
"""What OpenShift's namespace controller writes on every namespace (values of one such
namespace): the range restricted-v2 draws users and groups from, and its SELinux level."""


@dataclass(frozen=True)
class Admission:
    errors: list[str]
    """Why the SCC refuses the pod; empty: it admits it."""
    pod: dict[str, Any]
    """The pod with the security contexts the SCC gives it."""


def ensure_scc_check(progress: Progress = stderr_progress) -> Path:
    """The binary, built once per version of its source into the cache."""
    return ensure_go_program(
        "scc-check",
        SOURCE,
        (LIBRARY_MODULE, API_MODULE),
        "gpuusage builds OpenShift's SCC admission from Go modules once.",
        progress,
        kubernetes=KUBERNETES,
        replaces=(LIBRARY_GO,),
    )


def admit(
    binary: Path, scc: dict[str, Any], pod: dict[str, Any], namespace: str = "gpuusage-system"
) -> Admission:
    """Whether `scc` admits `pod` in a namespace as OpenShift annotates one."""
    ns = {"metadata": {"name": namespace, "annotations": NAMESPACE_RANGES}}
    body = json.dumps({"namespace": ns, "scc": scc, "pod": pod})
    proc = subprocess.run(
        [str(binary)], input=body, capture_output=True, text=True, check=False, timeout=60
    )
    if proc.returncode != 0:
        raise BinariesError(f"scc-check failed ({proc.returncode}): {proc.stderr.strip()}")
    answer = json.loads(proc.stdout)
    return Admission(errors=list(answer["errors"]), pod=answer["pod"])
