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
from pathlib import Path

import pytest

from gpuusage import __version__
from gpuusage_dev.localcluster.containerd import Containerd
from gpuusage_dev.localcluster.platforms import HOST
from gpuusage_dev.localcluster.tools import COSIGN, CRANE, ensure_tool
from gpuusage_dev.release.imagecheck import layout_blobs
from gpuusage_dev.release.images import Built, build
from gpuusage_dev.release.publish import PublishError, publish, push, signer, verify
from gpuusage_dev.release.registry import LocalRegistry, running_registry

pytestmark = [pytest.mark.slow, pytest.mark.node]

Released = tuple[LocalRegistry, list[Built], dict[str, str], Path]
"""The registry, the images built, each one's reference by digest, and dist/."""


@pytest.fixture(scope="module")
def released(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Released]:
    if shutil.which("mmdebstrap") is None or os.geteuid() != 0:
        pytest.skip("the images' Debian base needs mmdebstrap, as root")
    work = tmp_path_factory.mktemp("release")
    built = build(work / "dist" / "images", platforms=(HOST,))
    with running_registry(work / "registry") as registry:
        tools = {"crane": ensure_tool(CRANE), "cosign": ensure_tool(COSIGN)}
        published = publish(built, f"{registry.host}/gpuusage", __version__, work / "dist", tools)
        yield registry, built, published, work / "dist"


def test_each_image_is_pushed_signed_and_attested(
    released: Released,
) -> None:
    registry, built, published, dist = released
    cosign = ensure_tool(COSIGN)
    assert sorted(published) == sorted(b.name for b in built)
    for one in built:
        reference = published[one.name]
        short = one.name.rsplit("/", 1)[-1].split(":", 1)[0]
        assert reference == f"{registry.host}/gpuusage/{short}@{one.digest}"
        said = verify(cosign, dist / "cosign.pub", reference)
        claims = json.loads(said.strip().splitlines()[-1])
        assert {c["critical"]["image"]["docker-manifest-digest"] for c in claims} == {one.digest}
        # cosign lists the attestations' bundles too: the image's own signature must be there.
        assert "https://sigstore.dev/cosign/sign/v1" in {c["critical"]["type"] for c in claims}
        verify(cosign, dist / "cosign.pub", reference, "slsaprovenance1")
        platform = f"{registry.host}/gpuusage/{short}@{one.platforms[str(HOST)]}"
        verify(cosign, dist / "cosign.pub", platform, "spdxjson")
    again, made = signer(cosign, dist, {})
    assert (again.key, made) == (dist / "cosign.key", False), "dist's key is kept, never replaced"
    stranger, _ = signer(cosign, dist / "stranger", {})  # another key: not the release's
    with pytest.raises(PublishError):
        verify(cosign, stranger.public, published[built[0].name])


def test_an_image_changed_after_signing_fails_verification(
    released: Released,
) -> None:
    """A layer added to the signed image (as a compromised registry or a mistaken push would)
    is another digest: cosign finds no signature for it."""
    registry, built, published, dist = released
    crane, cosign = ensure_tool(CRANE), ensure_tool(COSIGN)
    one = built[0]
    short = one.name.rsplit("/", 1)[-1].split(":", 1)[0]
    layer = dist / "evil.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("usr/local/bin/evil")
        info.size = 4
        archive.addfile(info, io.BytesIO(b"evil"))
    layer.write_bytes(buffer.getvalue())
    platform = f"{registry.host}/gpuusage/{short}@{one.platforms[str(HOST)]}"
    verify(cosign, dist / "cosign.pub", platform)  # signed with the index (--recursive)
    tampered = f"{registry.host}/gpuusage/{short}:tampered"
    subprocess.run(
        [str(crane), "append", "-b", platform, "-f", str(layer), "-t", tampered],
        check=True,
        capture_output=True,
    )
    with pytest.raises(PublishError, match=r"no signatures found|no matching signatures"):
        verify(cosign, dist / "cosign.pub", tampered)
    verify(cosign, dist / "cosign.pub", published[one.name])


def test_containerd_pulls_by_digest_and_a_tampered_layer_fails_the_pull(
    released: Released, containerd: Containerd
) -> None:
    registry, built, published, _ = released
    agent = next(b for b in built if "agent" in b.name)
    reference = published[agent.name]
    pulled = containerd.ctr("images", "pull", "--plain-http", reference, check=False)
    assert pulled.returncode == 0, pulled.stderr.decode()[-800:]
    ran = containerd.ctr(
        "run",
        "--rm",
        reference,
        "pulled-agent",
        "python",
        "-m",
        "gpuusage",
        "--version",
        check=False,
    )
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
    registry, built, _, _ = released
    agent = next(b for b in built if "agent" in b.name)
    operator = next(b for b in built if "operator" in b.name)
    impostor = dataclasses.replace(operator, name=agent.name)
    with pytest.raises(PublishError, match="never moves a version's tag"):
        push(ensure_tool(CRANE), impostor, f"{registry.host}/gpuusage", __version__)
    assert push(ensure_tool(CRANE), agent, f"{registry.host}/gpuusage", __version__).endswith(
        agent.digest
    ), "the same build again is no move"
