"""What docs/install.md asks users to apply for the release is what the real tools take: its
Kyverno policy admitting only signed gpuusage images is an ImageValidatingPolicy the apiserver
accepts under Kyverno's own CRD (from its Go module at a pinned version), with strict field
validation, so a misspelt or misplaced field fails here and not on a user's cluster."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpuusage_dev.localcluster.tools import KYVERNO_CRDS, crds
from tests.conftest import Kubectl, wait_for

pytestmark = pytest.mark.cluster

INSTALL = Path(__file__).resolve().parents[1] / "docs" / "install.md"


def _yaml_blocks() -> list[str]:
    return [str(b) for b in re.findall(r"```yaml\n(.*?)```", INSTALL.read_text(), re.DOTALL)]


def install_doc_policy() -> str:
    """The one yaml block of docs/install.md that is a Kyverno ImageValidatingPolicy."""
    policies = [b for b in _yaml_blocks() if "kind: ImageValidatingPolicy" in b]
    assert len(policies) == 1, "docs/install.md shows one Kyverno ImageValidatingPolicy"
    return str(policies[0])


@pytest.fixture
def kyverno_kinds(kubectl: Kubectl) -> Iterator[None]:
    kubectl.run("apply", "--server-side", *(a for p in crds(KYVERNO_CRDS) for a in ("-f", str(p))))
    wait_for(lambda: _established(kubectl), what="Kyverno's ImageValidatingPolicy CRD established")
    yield
    kubectl.run(
        "delete",
        "--ignore-not-found",
        "--wait=true",
        "crd/imagevalidatingpolicies.policies.kyverno.io",
    )


def _established(kubectl: Kubectl) -> bool:
    shown = kubectl.run(
        "get",
        "crd/imagevalidatingpolicies.policies.kyverno.io",
        "-o",
        'jsonpath={.status.conditions[?(@.type=="Established")].status}',
        check=False,
    )
    return shown.strip() == "True"


def test_the_install_docs_kyverno_policy_is_one_kyverno_takes(
    kubectl: Kubectl, kyverno_kinds: None
) -> None:
    policy = install_doc_policy()
    spec = yaml.safe_load(policy)["spec"]
    assert "verifyImageSignatures" in spec["validations"][0]["expression"], "it verifies images"
    kubectl.run("create", "--dry-run=server", "--validate=strict", "-f", "-", stdin=policy)
    identity = spec["attestors"][0]["cosign"]["keyless"]["identities"][0]
    workflow = "https://github.com/gpuusage/gpuusage/.github/workflows/release.yml@refs/tags/"
    assert re.fullmatch(identity["subjectRegExp"], workflow + "v0.1.0")
    assert not re.fullmatch(
        identity["subjectRegExp"], workflow.replace("gpuusage/gpuusage", "x/y") + "v0.1.0"
    )
    # The attestors the text gives for a key pair's signatures, in the same policy.
    (attestors,) = [b for b in _yaml_blocks() if b.startswith("attestors:")]
    keyed = yaml.safe_load(policy)
    keyed["spec"]["attestors"] = yaml.safe_load(attestors)["attestors"]
    assert "key" in keyed["spec"]["attestors"][0]["cosign"]
    kubectl.run(
        "create", "--dry-run=server", "--validate=strict", "-f", "-", stdin=yaml.safe_dump(keyed)
    )
    # The same check refuses a field Kyverno does not have: it can fail.
    wrong = policy.replace("subjectRegExp:", "subjectRegexp:")
    said = kubectl.run(
        "create", "--dry-run=server", "--validate=strict", "-f", "-", stdin=wrong, check=False
    )
    assert "unknown field" in said, said
    assert "subjectRegexp" in said, said
