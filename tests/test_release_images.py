"""The release's images: one OCI index per image for linux/amd64 and linux/arm64, each
platform's compiled files for its CPU, its own `--version` run where this machine can run it,
and the same digests from the same commit (gpuusage_dev.release.images)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuusage import __version__
from gpuusage_dev import krewplugin
from gpuusage_dev.localcluster import productimages
from gpuusage_dev.localcluster.binaries import cache_root
from gpuusage_dev.localcluster.images import (
    OCI_INDEX,
    File,
    Image,
    Platform,
    image_manifest,
    index_archive,
    layer_tar,
)
from gpuusage_dev.localcluster.platforms import (
    HOST,
    RELEASE_PLATFORMS,
    cannot_emulate,
    elf_architecture,
    host_platform,
)
from gpuusage_dev.localcluster.productimages import (
    ImageBuildError,
    git_revision,
    product_image,
    product_images,
)
from gpuusage_dev.release import images as release_images
from gpuusage_dev.release.assets import KREW_MANIFEST, AssetError, plugin_assets, write_sums
from gpuusage_dev.release.imagecheck import (
    INTERPRETER,
    layout_blobs,
    platform_images,
    wrong_cpu,
)
from gpuusage_dev.release.images import build, check
from gpuusage_dev.release.provenance import statement
from gpuusage_dev.release.sbom import installed, purl_version, sbom_problems
from tests.conftest import release_test_platforms

REPO = Path(__file__).resolve().parents[1]
AMD64, ARM64 = Platform("amd64"), Platform("arm64")


def elf(machine: int) -> bytes:
    """The first bytes of a 64-bit little-endian ELF file for `machine` (e_machine)."""
    return b"\x7fELF\x02\x01\x01" + b"\0" * 11 + machine.to_bytes(2, "little") + b"\0" * 44


def test_a_platform_is_read_and_named_as_oci_names_it() -> None:
    assert Platform.parse("linux/arm64") == ARM64
    assert str(ARM64) == "linux/arm64"
    with pytest.raises(ValueError, match="OS/ARCHITECTURE"):
        Platform.parse("arm64")
    assert host_platform("aarch64") == ARM64
    assert host_platform("x86_64") == AMD64
    with pytest.raises(ValueError, match="not riscv64"):
        host_platform("riscv64")
    assert RELEASE_PLATFORMS == (AMD64, ARM64)


def test_another_cpu_needs_qemu_registered_with_binfmt(tmp_path: Path) -> None:
    assert cannot_emulate(AMD64, tmp_path, host=AMD64) is None
    why = cannot_emulate(ARM64, tmp_path, host=AMD64)
    assert why is not None
    assert "update-binfmts --enable qemu-aarch64" in why
    (tmp_path / "qemu-aarch64").write_text("disabled\ninterpreter /usr/bin/qemu-aarch64\n")
    assert cannot_emulate(ARM64, tmp_path, host=AMD64) is not None
    (tmp_path / "qemu-aarch64").write_text("enabled\ninterpreter /usr/bin/qemu-aarch64\n")
    assert cannot_emulate(ARM64, tmp_path, host=AMD64) is None
    assert "not linux/riscv64" in (cannot_emulate(Platform("riscv64"), tmp_path, AMD64) or "")


def test_an_elf_header_says_its_cpu() -> None:
    assert elf_architecture(elf(0x3E)) == "amd64"
    assert elf_architecture(elf(0xB7)) == "arm64"
    assert elf_architecture(elf(0xF3)) is None  # riscv: no image is built for it
    assert elf_architecture(b"#!/bin/sh\n" + b"\0" * 20) is None
    assert elf_architecture(elf(0x3E)[:4] + b"\x01" + elf(0x3E)[5:]) is None  # 32-bit


def _layers(files: dict[str, bytes]) -> list[bytes]:
    return [layer_tar({path: File(content, 0o755) for path, content in files.items()})]


def test_a_file_of_another_cpu_is_named() -> None:
    site = "usr/local/lib/python3.11/dist-packages"
    good = {
        INTERPRETER: elf(0xB7),
        f"{site}/yaml/_yaml.cpython-311-aarch64-linux-gnu.so": elf(0xB7),
    }
    assert wrong_cpu(_layers(good), ARM64) == []
    bad = {**good, f"{site}/pydantic_core/_core.so": elf(0x3E), f"{site}/x/lib.so.1": b"text"}
    assert wrong_cpu(_layers(bad), ARM64) == [
        f"{site}/pydantic_core/_core.so: amd64",
        f"{site}/x/lib.so.1: not a 64-bit ELF of a known CPU",
    ]
    assert wrong_cpu(_layers({f"{site}/a.py": b"print()"}), ARM64) == [f"{INTERPRETER}: missing"]


def test_an_index_names_each_platform_and_keeps_each_ones_layers() -> None:
    image = Image("x/y:1", {}, cmd=("/bin/sh",), labels={"a": "b"})
    when = "2026-11-28T00:00:00Z"
    amd = image_manifest(image, _layers({INTERPRETER: elf(0x3E)}), AMD64, when, compress=True)
    arm = image_manifest(image, _layers({INTERPRETER: elf(0xB7)}), ARM64, when, compress=True)
    layer = json.loads(arm.manifest)["layers"][0]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert gzip.decompress(arm.blobs[0]) == _layers({INTERPRETER: elf(0xB7)})[0]
    archive = index_archive("x/y:1", [amd, arm])
    assert archive == index_archive("x/y:1", [amd, arm]), "the same inputs, the same bytes"
    entry, blobs = layout_blobs(archive)
    assert entry["mediaType"] == OCI_INDEX
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == "x/y:1"
    index = json.loads(blobs[entry["digest"]])
    assert [m["platform"] for m in index["manifests"]] == [
        {"architecture": "amd64", "os": "linux"},
        {"architecture": "arm64", "os": "linux"},
    ]
    layers = {p: stack for p, (stack, _) in platform_images(archive).items()}
    assert {p: wrong_cpu(stack, p) for p, stack in layers.items()} == {AMD64: [], ARM64: []}
    config = json.loads(blobs[json.loads(arm.manifest)["config"]["digest"]])
    assert (config["architecture"], config["created"]) == ("arm64", "2026-11-28T00:00:00Z")
    assert config["history"][0]["created"] == "2026-11-28T00:00:00Z"


def test_the_provenance_names_the_commit_the_command_and_the_locked_inputs() -> None:
    digest = "sha256:" + "ab" * 32
    env = {
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_WORKFLOW_REF": "gpuusage/gpuusage/.github/workflows/release.yml@refs/tags/v0.1.0",
    }
    made = statement(
        REPO,
        "nodeagent/Dockerfile",
        "ghcr.io/gpuusage/gpuusage-agent",
        digest,
        platforms=RELEASE_PLATFORMS,
        command="make release VERSION=0.1.0",
        env=env,
    )
    assert made["_type"] == "https://in-toto.io/Statement/v1"
    assert made["predicateType"] == "https://slsa.dev/provenance/v1"
    assert made["subject"] == [
        {"name": "ghcr.io/gpuusage/gpuusage-agent", "digest": {"sha256": "ab" * 32}}
    ]
    build_definition = made["predicate"]["buildDefinition"]
    revision = git_revision(REPO)
    assert build_definition["externalParameters"]["source"] == {
        "uri": "git+https://github.com/gpuusage/gpuusage",
        "digest": {"gitCommit": revision},
    }
    assert build_definition["externalParameters"]["command"] == "make release VERSION=0.1.0"
    assert build_definition["externalParameters"]["platforms"] == ["linux/amd64", "linux/arm64"]
    hashed = {
        d["uri"].rsplit(f"{revision}/", 1)[-1]: d["digest"]
        for d in build_definition["resolvedDependencies"]
    }
    for name in ("nodeagent/Dockerfile", "nodeagent/requirements.lock"):
        assert hashed[name] == {"sha256": hashlib.sha256((REPO / name).read_bytes()).hexdigest()}
    assert made["predicate"]["runDetails"]["builder"]["id"] == (
        "https://github.com/gpuusage/gpuusage/.github/workflows/release.yml@refs/tags/v0.1.0"
    )
    local = statement(REPO, "nodeagent/Dockerfile", "x", digest, platforms=(), command="c", env={})
    assert local["predicate"]["runDetails"]["builder"]["id"].startswith("urn:gpuusage:builder:")
    with pytest.raises(ValueError, match="sha256:<64 hex digits>"):
        statement(REPO, "nodeagent/Dockerfile", "x", "sha256:12", platforms=(), command="c")


def _index_digests(out: Path) -> dict[str, object]:
    return dict(json.loads((out / "digests.json").read_text()))


@pytest.mark.slow
@pytest.mark.node
def test_the_release_images_are_for_their_cpus_run_and_reproduce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built without Docker for the release's platforms (this machine's own in CI's form):
    every compiled file is for its platform's CPU, `python -m gpuusage --version` runs in
    each one's root, the host's manifest is the very one the local node runs, and a second
    build with nothing cached but the Debian bases gives the same digests."""
    if shutil.which("mmdebstrap") is None or os.geteuid() != 0:
        pytest.skip("the images' Debian base needs mmdebstrap, as root")
    platforms = release_test_platforms()
    for platform in platforms:
        why = cannot_emulate(platform)
        if why is not None:
            pytest.skip(why)
    first = build(tmp_path / "first", platforms=platforms)
    assert sorted(b.name for b in first) == sorted(product_images(REPO))
    for one in first:
        assert sorted(one.platforms) == sorted(map(str, platforms))
        assert one.ran == dict.fromkeys(map(str, platforms), f"gpuusage {__version__}")
        local = product_image(REPO, product_images(REPO)[one.name], one.name)
        entry, _ = layout_blobs(local)
        assert entry["digest"] == one.platforms[str(HOST)], "the node runs what is released"
        made = json.loads(
            one.archive.with_name(
                one.archive.name.replace(".oci.tar", ".provenance.json")
            ).read_text()
        )
        assert made["subject"][0]["digest"]["sha256"] == one.digest.removeprefix("sha256:")
        for platform in platforms:  # made by syft, held to the image's dpkg and dist-info
            document = json.loads(one.sboms[str(platform)].read_text())
            assert document["spdxVersion"] == "SPDX-2.3"
            names = {p["name"] for p in document["packages"]}
            assert {"python3.11", "libc6", "pydantic"} <= names, platform
    # Again, from a cache holding only the Debian bases: the dependencies and the sources are
    # installed, compiled and packed anew.
    cache = tmp_path / "cache"
    (cache / "images").mkdir(parents=True)
    for base in (cache_root() / "images").glob("base-*.tar"):
        os.link(base, cache / "images" / base.name)
    monkeypatch.setenv("GPUUSAGE_CACHE_DIR", str(cache))
    build(tmp_path / "second", platforms=platforms)
    assert _index_digests(tmp_path / "second") == _index_digests(tmp_path / "first")


STATUS = """Package: libc6
Status: install ok installed
Architecture: arm64
Version: 2.36-9+deb12u13

Package: zlib1g
Status: install ok installed
Version: 1:1.2.13.dfsg-1

Package: gone
Status: deinstall ok config-files
Version: 1.0
"""
METADATA = "Metadata-Version: 2.1\nName: PyYAML\nVersion: 6.0.4\n\nA long description: Name: x\n"


def _sbom_package(name: str, version: str, purl: str, license_id: str) -> dict[str, object]:
    return {
        "name": name,
        "versionInfo": version,
        "licenseDeclared": license_id,
        "licenseConcluded": "NOASSERTION",
        "externalRefs": [{"referenceType": "purl", "referenceLocator": purl}],
    }


def test_the_sbom_is_held_to_what_the_image_holds() -> None:
    site = "usr/local/lib/python3.11/dist-packages"
    layers = _layers(
        {
            "var/lib/dpkg/status": STATUS.encode(),
            f"{site}/PyYAML-6.0.4.dist-info/METADATA": METADATA.encode(),
        }
    )
    held = installed(layers)
    assert held.debian == {"libc6": "2.36-9+deb12u13", "zlib1g": "1:1.2.13.dfsg-1"}
    assert held.python == {"pyyaml": "6.0.4"}
    document = {
        "packages": [
            _sbom_package(
                "libc6",
                "2.36-9+deb12u13",
                "pkg:deb/debian/libc6@2.36-9%2Bdeb12u13?arch=arm64",
                "LicenseRef-x",
            ),
            _sbom_package(
                "zlib1g",
                "1:1.2.13.dfsg-1",
                "pkg:deb/debian/zlib1g@1.2.13.dfsg-1?arch=arm64&epoch=1",
                "Zlib",
            ),
            _sbom_package("pyyaml", "6.0.4", "pkg:pypi/pyyaml@6.0.4", "MIT"),
        ],
        "hasExtractedLicensingInfos": [
            {"licenseId": "LicenseRef-x", "extractedText": "NOASSERTION"}
        ],
    }
    assert sbom_problems(document, held) == ([], ["deb libc6"])
    packages = document["packages"]
    assert isinstance(packages, list)
    wrong = {
        **document,
        "packages": [packages[0], _sbom_package("pyyaml", "6.0.3", "pkg:pypi/pyyaml@6.0.3", "MIT")],
    }
    assert sbom_problems(wrong, held)[0] == [
        "deb zlib1g 1:1.2.13.dfsg-1: not in the SBOM",
        "pypi pyyaml: 6.0.3 in the SBOM, 6.0.4 installed",
        "pypi pyyaml: purl pkg:pypi/pyyaml@6.0.3 names another version",
    ]
    assert purl_version("pkg:deb/debian/zlib1g@1%3A1.2.13?arch=amd64") == "1:1.2.13"


def test_the_release_assets_are_summed_and_held_to_the_krew_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHA256SUMS as coreutils checks it; a Krew manifest naming other archives stops it."""

    def fake_build(out: Path, repo: Path) -> dict[krewplugin.Platform, str]:
        digests = {}
        for platform in krewplugin.PLATFORMS:
            data = f"archive for {platform.os}/{platform.arch}".encode()
            (out / platform.archive).write_bytes(data)
            digests[platform] = hashlib.sha256(data).hexdigest()
        return digests

    monkeypatch.setattr(krewplugin, "build", fake_build)
    repo, out = tmp_path / "repo", tmp_path / "dist"
    out.mkdir()
    (repo / krewplugin.MANIFEST).parent.mkdir(parents=True)
    (repo / krewplugin.MANIFEST).write_text("an older manifest\n")
    with pytest.raises(AssetError, match="make plugin"):
        plugin_assets(out, repo)
    (repo / krewplugin.MANIFEST).write_text(krewplugin.manifest(fake_build(out, repo)))
    written = plugin_assets(out, repo)
    assert [p.name for p in written][-1] == KREW_MANIFEST
    assert len(written) == len(krewplugin.PLATFORMS) + 1
    assert (out / KREW_MANIFEST).read_text() == (repo / krewplugin.MANIFEST).read_text()
    chart_archive = out / "gpuusage-1.2.3.tgz"
    chart_archive.write_bytes(b"a chart")
    assert write_sums(out, [*written, chart_archive]) == out / "SHA256SUMS"
    named = [line.split()[1] for line in (out / "SHA256SUMS").read_text().splitlines()]
    assert named == sorted(p.name for p in [*written, chart_archive])
    checked = subprocess.run(
        ["sha256sum", "--check", "--strict", "SHA256SUMS"],
        cwd=out,
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (out / krewplugin.PLATFORMS[0].archive).write_bytes(b"changed")
    assert (
        subprocess.run(
            ["sha256sum", "--check", "SHA256SUMS"], cwd=out, capture_output=True, check=False
        ).returncode
        != 0
    )


def test_a_release_image_lacking_a_platform_or_a_run_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = Image("x/y:1", {})
    amd = image_manifest(image, _layers({INTERPRETER: elf(0x3E)}), AMD64)
    archive = index_archive("x/y:1", [amd])
    with pytest.raises(ImageBuildError, match="lacks linux/arm64"):
        check(platform_images(archive), "0.1.0", (AMD64, ARM64))
    monkeypatch.setattr(release_images, "cannot_emulate", lambda _: "no qemu here")
    assert check(platform_images(archive), "0.1.0", (AMD64,)) == {}, (
        "make images: not run, and it says so"
    )
    with pytest.raises(ImageBuildError, match="runs each image's --version: no qemu here"):
        check(platform_images(archive), "0.1.0", (AMD64,), must_run=True)


def test_an_image_is_rebuilt_when_its_base_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached image is keyed by its base's and its dependencies' makings too."""
    name, dockerfile = next(iter(product_images(REPO).items()))
    before = productimages._cached_build(REPO, dockerfile, name, (AMD64,), index=True)
    monkeypatch.setattr(productimages, "BASE_PACKAGES", (*productimages.BASE_PACKAGES, "curl"))
    assert productimages._cached_build(REPO, dockerfile, name, (AMD64,), index=True) != before
    monkeypatch.undo()
    monkeypatch.setattr(productimages, "WHEEL_PLATFORMS", {"amd64": "manylinux_2_28_x86_64"})
    assert productimages._cached_build(REPO, dockerfile, name, (AMD64,), index=True) != before


def test_the_dependencies_carry_no_trace_of_the_checkout_that_built_them(tmp_path: Path) -> None:
    """pip's console scripts name its own interpreter (this checkout's virtualenv) on their
    first line, and RECORD hashes them: both go, or two checkouts build different layers."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "idna").write_text("#!/work/a/.venv/bin/python\n")
    info = tmp_path / "idna-3.20.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(
        "../../bin/idna,sha256=abc,166\nidna/__init__.py,sha256=def,849\nidna-3.20.dist-info/RECORD,,\n"
    )
    productimages.drop_scripts(tmp_path)
    assert not (tmp_path / "bin").exists()
    assert (info / "RECORD").read_text() == (
        "idna/__init__.py,sha256=def,849\nidna-3.20.dist-info/RECORD,,\n"
    )
