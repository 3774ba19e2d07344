"""The compatibility run: the tests of install, allocation, DRA and the real node (the `compat`
marker) on each supported Kubernetes release, one release after another.

`make test-compat` runs every release with the node's tests; `make test-oldest` (CI's second
run) the oldest release without them. Each release's programs are built once and cached
(binaries); each run is a pytest of its own with GPUUSAGE_KUBERNETES_VERSION set, so every
control plane and node it starts is of that release. The table printed at the end is what
docs/development.md records, with the date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.binaries import ensure_binaries, ensure_node_binaries


@dataclass(frozen=True)
class Outcome:
    version: str
    passed: int
    failed: int
    skipped: int
    seconds: float

    @property
    def row(self) -> str:
        return (
            f"| {self.version} | {self.passed} | {self.failed} | {self.skipped} | "
            f"{self.seconds:.0f} s |"
        )


def counts(junit: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) from pytest's JUnit XML: errors count as failures."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests, failures, errors, skipped = (
        int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")
    )
    return tests - failures - errors - skipped, failures + errors, skipped


def run(version: str, *, node: bool, workers: int, scratch: Path) -> Outcome:
    ensure_binaries(version=version)
    if node:
        ensure_node_binaries(version=version)
    junit = scratch / f"compat-{version}.xml"
    marker = "compat" if node else "compat and not node"
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            marker,
            "-n",
            str(workers),
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
        ],
        env={**os.environ, versions.ENV: version},
        check=False,
    )
    passed, failed, skipped = counts(junit) if junit.exists() else (0, 1, 0)
    return Outcome(version, passed, failed, skipped, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--oldest", action="store_true", help="only the oldest release")
    parser.add_argument("--release", help="only this supported release (e.g. 1.36)")
    parser.add_argument("--no-node", action="store_true", help="without the real node's tests")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--scratch", type=Path, default=Path("build"))
    args = parser.parse_args(argv)
    if args.release:
        chosen = [versions.choose(args.release)]
    else:
        chosen = [versions.OLDEST] if args.oldest else list(versions.SUPPORTED)
    args.scratch.mkdir(parents=True, exist_ok=True)
    outcomes = [
        run(v, node=not args.no_node, workers=args.workers, scratch=args.scratch) for v in chosen
    ]
    print(f"\ncompatibility run, {datetime.date.today().isoformat()}:")
    print("| Kubernetes | passed | failed | skipped | time |")
    print("| --- | --- | --- | --- | --- |")
    for outcome in outcomes:
        print(outcome.row)
    return 1 if any(o.failed or not o.passed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
