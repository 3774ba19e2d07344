"""The release published and consumed as a platform team would: pushed to a real registry (the
CNCF Distribution registry on loopback), signed and attested with cosign, verified with cosign,
pulled by digest by containerd and run; a tampered image fails verification, a tampered layer
fails the pull (gpuusage_dev.release.publish)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuusage import __version__
from gpuusage_dev.localcluster.cluster import free_port
from gpuusage_dev.localcluster.containerd import Containerd
from gpuusage_dev.localcluster.platforms import HOST
from gpuusage_dev.localcluster.productimages import REPO
from gpuusage_dev.localcluster.tools import COSIGN, CRANE, HELM, ensure_tool
from gpuusage_dev.release import chart
from gpuusage_dev.release.imagecheck import layout_blobs
from gpuusage_dev.release.images import Built, build, short_name
from gpuusage_dev.release.publish import (
    PublishError,
    Signer,
    held,
    publish,
    push,
    push_chart,
    signer,
    verify,
)
from gpuusage_dev.release.registry import LocalRegistry, running_registry
from tests.conftest import Helm

pytestmark = [pytest.mark.slow, pytest.mark.node]


@dataclass(frozen=True)
class Released:
    registry: LocalRegistry
    built: list[Built]
    published: dict[str, str]
    """Each image's name, and "chart", → its reference by digest."""
    dist: Path
    key: Signer
    packaged: Path
    """The chart's package."""


@pytest.fixture(scope="module")
def released(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Released]:
    if shutil.which("mmdebstrap") is None or os.geteuid() != 0:
        pytest.skip("the images' Debian base needs mmdebstrap, as root")
    work = tmp_path_factory.mktemp("release")
    dist = work / "dist"
    built = build(dist / "images", platforms=(HOST,))
    tools = {"crane": ensure_tool(CRANE), "cosign": ensure_tool(COSIGN), "helm": ensure_tool(HELM)}
    key, made = signer(tools["cosign"], dist, {})
    assert made, "a key pair is made where there is none"
    with running_registry(work / "registry") as registry:
        where = f"{registry.host}/gpuusage"
        packaged = chart.package(REPO, dist, tools["helm"], chart.pins(built, where))
        published = publish(built, packaged, where, __version__, key=key, tools=tools)
        yield Released(registry, built, published, dist, key, packaged)


def test_each_image_is_pushed_signed_and_attested(
    released: Released,
) -> None:
    registry, built, published, dist, key = (
        released.registry, released.built, released.published, released.dist, released.key
    )  # fmt: skip
    cosign = ensure_tool(COSIGN)
    assert sorted(published) == sorted([*(b.name for b in built), "chart"])
    for one in built:
        reference = published[one.name]
        short = short_name(one.name)
        assert reference == f"{registry.host}/gpuusage/{short}@{one.digest}"
        said = verify(cosign, key, reference)
        claims = json.loads(said.strip().splitlines()[-1])
        assert {c["critical"]["image"]["docker-manifest-digest"] for c in claims} == {one.digest}
        # cosign lists the attestations' bundles too: the image's own signature must be there.
        assert "https://sigstore.dev/cosign/sign/v1" in {c["critical"]["type"] for c in claims}
        verify(cosign, key, reference, "slsaprovenance1")
        platform = f"{registry.host}/gpuusage/{short}@{one.platforms[str(HOST)]}"
        verify(cosign, key, platform, "spdxjson")
    again, made = signer(cosign, dist, {})
    assert (again.key, made) == (dist / "cosign.key", False), "dist's key is kept, never replaced"
    stranger, _ = signer(cosign, dist / "stranger", {})  # another key: not the release's
    for reference in (published[built[0].name], published["chart"]):
        with pytest.raises(PublishError):
            verify(cosign, stranger, reference)


def test_the_chart_is_pushed_signed_and_pulled_with_its_images_pinned(
    released: Released, helm_binary: Path, tmp_path: Path
) -> None:
    """`helm pull oci://...` gets the very package built, signed (cosign verify of its
    digest), its values naming each image where it was pushed, by digest."""
    registry, published = released.registry, released.published
    reference = published["chart"]
    assert reference.startswith(f"{registry.host}/gpuusage/charts/gpuusage@sha256:")
    verify(ensure_tool(COSIGN), released.key, reference)
    helm = Helm(helm_binary, tmp_path / "helm")
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    helm.run(
        "pull", f"oci://{registry.host}/gpuusage/charts/gpuusage", "--version", __version__,
        "--plain-http", "--destination", str(pulled),
    )  # fmt: skip
    (archive,) = pulled.glob("*.tgz")
    assert archive.read_bytes() == released.packaged.read_bytes()
    values = yaml.safe_load(helm.run("show", "values", str(archive)).stdout)
    for one in released.built:
        short = short_name(one.name)
        image = values[chart.COMPONENTS[short]]["image"]
        pulled_from = f"{values['image']['registry']}/{image['repository']}@{image['digest']}"
        assert pulled_from == published[one.name]


def test_an_image_changed_after_signing_fails_verification(
    released: Released,
) -> None:
    """A layer added to the signed image (as a compromised registry or a mistaken push would)
    is another digest: cosign finds no signature for it."""
    registry, built, published, dist, key = (
        released.registry, released.built, released.published, released.dist, released.key
    )  # fmt: skip
    crane, cosign = ensure_tool(CRANE), ensure_tool(COSIGN)
    one = built[0]
    short = short_name(one.name)
    layer = dist / "evil.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("usr/local/bin/evil")
        info.size = 4
        archive.addfile(info, io.BytesIO(b"evil"))
    layer.write_bytes(buffer.getvalue())
    platform = f"{registry.host}/gpuusage/{short}@{one.platforms[str(HOST)]}"
    verify(cosign, key, platform)  # signed with the index (--recursive)
    tampered = f"{registry.host}/gpuusage/{short}:tampered"
    subprocess.run(
        [str(crane), "append", "-b", platform, "-f", str(layer), "-t", tampered],
        check=True,
        capture_output=True,
    )
    with pytest.raises(PublishError, match=r"no signatures found|no matching signatures"):
        verify(cosign, key, tampered)
    verify(cosign, key, published[one.name])


def test_containerd_pulls_by_digest_and_a_tampered_layer_fails_the_pull(
    released: Released, containerd: Containerd
) -> None:
    registry, built, published = released.registry, released.built, released.published
    agent = next(b for b in built if "agent" in b.name)
    reference = published[agent.name]
    pulled = containerd.ctr("images", "pull", "--plain-http", reference, check=False)
    assert pulled.returncode == 0, pulled.stderr.decode()[-800:]
    ran = containerd.run_to_end(reference, "pulled-agent", "python", "-m", "gpuusage", "--version")
    assert ran.stdout.decode().strip() == f"gpuusage {__version__}", ran.stderr.decode()[-800:]
    # A layer's bytes changed in the registry's storage: the pull by digest refuses them.
    operator = next(b for b in built if "operator" in b.name)
    blobs = registry.directory / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256"
    manifest = json.loads(containerd_manifest(operator, str(HOST)))
    top = manifest["layers"][-1]["digest"].removeprefix("sha256:")
    data = blobs / top[:2] / top / "data"
    original = data.read_bytes()
    data.write_bytes(original[:-16] + b"\0" * 16)
    assert hashlib.sha256(data.read_bytes()).hexdigest() != top
    refused = containerd.ctr(
        "images", "pull", "--plain-http", published[operator.name], check=False
    )
    assert refused.returncode != 0
    assert "digest" in refused.stderr.decode().lower()


def containerd_manifest(one: Built, platform: str) -> bytes:
    _, blobs = layout_blobs(one.archive.read_bytes())
    return blobs[one.platforms[platform]]


def test_a_version_tag_is_never_moved(released: Released) -> None:
    """Pushing another build under a version already published is refused, naming both."""
    registry, built = released.registry, released.built
    agent = next(b for b in built if "agent" in b.name)
    operator = next(b for b in built if "operator" in b.name)
    impostor = dataclasses.replace(operator, name=agent.name)
    with pytest.raises(PublishError, match="never moves a version's tag"):
        push(ensure_tool(CRANE), impostor, f"{registry.host}/gpuusage", __version__)
    assert push(ensure_tool(CRANE), agent, f"{registry.host}/gpuusage", __version__).endswith(
        agent.digest
    ), "the same build again is no move"
    crane = ensure_tool(CRANE)
    assert held(crane, "digest", f"{registry.host}/gpuusage/nothing:1.0.0") is None
    with pytest.raises(PublishError):  # a registry that does not answer is no "not there"
        held(crane, "digest", f"127.0.0.1:{free_port()}/gpuusage/gpuusage-agent:1.0.0")
    tools = {"crane": crane, "helm": ensure_tool(HELM)}
    where = f"{registry.host}/gpuusage"
    assert push_chart(tools, released.packaged, where, __version__) == released.published["chart"]
    other = released.dist / "other" / released.packaged.name
    other.parent.mkdir()
    other.write_bytes(released.packaged.read_bytes() + b"\0")
    with pytest.raises(PublishError, match="never moves a version's tag"):
        push_chart(tools, other, where, __version__)
