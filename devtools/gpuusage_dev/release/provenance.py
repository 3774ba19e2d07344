"""How each release image was made, as an in-toto statement with a SLSA v1 provenance
predicate (https://slsa.dev/spec/v1.0/provenance): the image index it speaks of (subject), the
source repository and commit, the command that built it, and, as resolved dependencies, the
files the build read to decide what goes in (the Dockerfile and the lock, by sha256). It is
attached to the image as a signed attestation, so a user can check which commit and which
locked dependencies an image came from before admitting it.

The builder is the hosted release workflow where it runs (GitHub's own variables name it), and
this machine otherwise; nothing here reads a clock, so the same build gives the same statement.
"""

from __future__ import annotations

import hashlib
import os
import socket
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuusage_dev.localcluster.images import GZIP_LEVEL, Platform
from gpuusage_dev.localcluster.productimages import (
    BASE_PACKAGES,
    DEBIAN_RELEASE,
    git_revision,
    recipe_of,
)
from gpuusage_dev.version import source_url, version_of

STATEMENT = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
COMPRESSION = f"gzip level {GZIP_LEVEL}, zlib {zlib.ZLIB_RUNTIME_VERSION}"
"""What the layers' bytes depend on besides their content (images.GZIP_LEVEL)."""
BUILD_TYPE_PATH = "docs/development.md#the-images"
"""What the build type's URI names: the page that says how the images are built."""


def builder_id(env: Mapping[str, str]) -> str:
    """Who built it: the hosted workflow's file at its ref where GitHub Actions ran it, else
    this machine."""
    workflow = env.get("GITHUB_WORKFLOW_REF")
    if workflow:
        return f"{env.get('GITHUB_SERVER_URL', 'https://github.com')}/{workflow}"
    return f"urn:gpuusage:builder:local:{socket.gethostname()}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def statement(
    repo: Path,
    dockerfile: str,
    image: str,
    digest: str,
    *,
    platforms: tuple[Platform, ...],
    command: str,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The provenance of the image index `image` (a name without tag) whose digest is
    `digest` (sha256:…), built from `dockerfile` by `command`."""
    env = os.environ if env is None else env
    source = source_url(repo)
    revision = git_revision(repo)
    recipe = recipe_of((repo / dockerfile).read_text())
    files = [dockerfile, *recipe.requirements]
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64:
        raise ValueError(f"an image digest is sha256:<64 hex digits>, not {digest!r}")
    return {
        "_type": STATEMENT,
        "subject": [{"name": image, "digest": {"sha256": hexdigest}}],
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": f"{source}/blob/{revision}/{BUILD_TYPE_PATH}",
                "externalParameters": {
                    "source": {
                        "uri": f"git+{source}",
                        "digest": {"gitCommit": revision},
                    },
                    "version": version_of(repo),
                    "dockerfile": dockerfile,
                    "platforms": [str(p) for p in platforms],
                    "command": command,
                },
                "internalParameters": {
                    "debianRelease": DEBIAN_RELEASE,
                    "basePackages": list(BASE_PACKAGES),
                    "bytecode": recipe.bytecode,
                    "layerCompression": COMPRESSION,
                },
                "resolvedDependencies": [
                    {"uri": f"git+{source}", "digest": {"gitCommit": revision}},
                    *(
                        {
                            "uri": f"{source}/blob/{revision}/{name}",
                            "digest": {"sha256": _sha256(repo / name)},
                        }
                        for name in files
                    ),
                ],
            },
            "runDetails": {"builder": {"id": builder_id(env)}},
        },
    }
