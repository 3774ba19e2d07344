"""The chart as the release packages it (gpuusage_dev.release.chart): its images pinned by digest
to where they were pushed, every other line of values.yaml as written, the package the same
bytes for the same commit; and how the release signs (gpuusage_dev.release.publish): a key
pair here, keyless only in the hosted workflow."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage_dev.chart import CHART
from gpuusage_dev.release import chart
from gpuusage_dev.release.images import Built
from gpuusage_dev.release.publish import GITHUB_ISSUER, PublishError, Signer, keyless_signer
from tests.conftest import Helm

REPO = Path(__file__).resolve().parents[1]
AGENT, OPERATOR = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def _built(name: str, digest: str) -> Built:
    return Built(name, Path("x"), digest, {}, {}, Path("p"), {}, [])


BUILT = [
    _built("ghcr.io/gpuusage/gpuusage-agent:0.1.0", AGENT),
    _built("ghcr.io/gpuusage/gpuusage-operator:0.1.0", OPERATOR),
]


def test_the_images_are_pinned_where_the_release_pushed_them() -> None:
    pins = chart.pins(BUILT, "127.0.0.1:5000/team/gpu")
    assert pins == {
        "agent": chart.Pin("127.0.0.1:5000", "team/gpu/gpuusage-agent", AGENT),
        "operator": chart.Pin("127.0.0.1:5000", "team/gpu/gpuusage-operator", OPERATOR),
    }
    assert chart.pins(BUILT, "registry.example")["agent"] == chart.Pin(
        "registry.example", "gpuusage-agent", AGENT
    )
    assert chart.pins(BUILT, "")["operator"] == chart.Pin("", "", OPERATOR), "digest only"
    with pytest.raises(chart.ChartError, match="no image named gpuusage-exporter"):
        chart.pins([_built("ghcr.io/x/gpuusage-exporter:1", AGENT)], "r")


def test_pinning_changes_those_values_and_no_other_line() -> None:
    text = (REPO / CHART / "values.yaml").read_text()
    pinned = chart.pinned_values(text, chart.pins(BUILT, "127.0.0.1:5000/gpuusage"))
    before, after = yaml.safe_load(text), yaml.safe_load(pinned)
    assert after["image"]["registry"] == "127.0.0.1:5000", "one registry, so one mirror --set"
    after["image"]["registry"] = before["image"]["registry"]
    for component, digest in (("agent", AGENT), ("operator", OPERATOR)):
        assert after[component]["image"] == {
            "registry": "",
            "repository": f"gpuusage/gpuusage-{component}",
            "tag": "",
            "digest": digest,
        }
        after[component]["image"] = before[component]["image"]
    assert after == before
    changed = [b for a, b in zip(text.splitlines(), pinned.splitlines(), strict=True) if a != b]
    assert len(changed) == 5
    assert all(line.endswith("# pinned by make release") for line in changed)
    assert chart.pinned_values(text, chart.pins(BUILT, "")).count("pinned by") == 2
    ipv6 = yaml.safe_load(chart.pinned_values(text, chart.pins(BUILT, "[::1]:5000/g")))
    assert ipv6["image"]["registry"] == "[::1]:5000"


def test_a_values_file_without_the_image_keys_is_refused() -> None:
    moved = "agent:\n  images:\n    digest: ''\noperator:\n  image:\n    digest: ''\n"
    with pytest.raises(chart.ChartError, match=r"no agent\.image\.digest"):
        chart.pinned_values(moved, chart.pins(BUILT, ""))
    own = "image:\n  registry: r\nagent:\n  image:\n    registry: elsewhere\n    digest: ''\n"
    with pytest.raises(chart.ChartError, match="would win over the pin"):
        chart.pinned_values(own, {"agent": chart.Pin("r", "", AGENT)})


def test_only_a_registry_on_this_machine_is_spoken_to_over_http() -> None:
    assert chart.loopback("127.0.0.1:5000/gpuusage")
    assert chart.loopback("localhost:5000")
    assert not chart.loopback("ghcr.io/gpuusage")
    assert not chart.loopback("127.example.com/x")  # a name, not an address on loopback
    assert chart.loopback("[::1]:5000/g")
    assert chart.loopback("[::1]")


@pytest.mark.slow
def test_the_packaged_chart_runs_the_pinned_images_and_reproduces(
    helm_binary: Path, tmp_path: Path
) -> None:
    pins = chart.pins(BUILT, "127.0.0.1:5000/gpuusage")
    first = chart.package(REPO, tmp_path / "a", helm_binary, pins)
    again = chart.package(REPO, tmp_path / "b", helm_binary, pins)
    assert first.name == again.name
    assert (
        hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(again.read_bytes()).digest()
    )
    helm = Helm(helm_binary, tmp_path / "helm")
    rendered = helm.run("template", "gpuusage", str(first), "-n", "gpuusage-system").stdout
    images: dict[str, Any] = {}
    for doc in yaml.safe_load_all(rendered):
        if doc and doc["kind"] in ("DaemonSet", "Deployment"):
            images[doc["metadata"]["name"]] = doc["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
    assert images == {
        "gpuusage-agent": f"127.0.0.1:5000/gpuusage/gpuusage-agent@{AGENT}",
        "gpuusage-operator": f"127.0.0.1:5000/gpuusage/gpuusage-operator@{OPERATOR}",
    }


def test_a_key_pair_signs_without_a_log_and_is_verified_by_its_public_key() -> None:
    key = Signer(Path("k.key"), Path("k.pub"), "pw", Path("config.json"))
    assert key.signing() == ["--key", "k.key", "--signing-config", "config.json"]
    assert key.checking() == ["--key", "k.pub", "--insecure-ignore-tlog=true"]
    assert key.env == {"COSIGN_PASSWORD": "pw"}


def test_keyless_signing_is_the_workflows_identity_and_only_there() -> None:
    workflow = {
        "GITHUB_WORKFLOW_REF": "gpuusage/gpuusage/.github/workflows/release.yml@refs/tags/v0.1.0",
        "ACTIONS_ID_TOKEN_REQUEST_URL": "https://token.example/request",
    }
    key = keyless_signer(workflow)
    assert (key.signing(), key.env) == ([], {}), "cosign's default: Fulcio and Rekor"
    assert key.checking() == [
        "--certificate-identity",
        "https://github.com/gpuusage/gpuusage/.github/workflows/release.yml@refs/tags/v0.1.0",
        "--certificate-oidc-issuer",
        GITHUB_ISSUER,
    ]
    with pytest.raises(PublishError, match="id-token: write"):
        keyless_signer({"GITHUB_WORKFLOW_REF": workflow["GITHUB_WORKFLOW_REF"]})
    with pytest.raises(PublishError, match="choose one"):
        keyless_signer({**workflow, "COSIGN_KEY": "k.key"})
