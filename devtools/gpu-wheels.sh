#!/usr/bin/env bash
# Fetch, here, the wheels the real-GPU suite needs that a GPU machine without a package
# registry lacks (its image has Python 3.12, pytest, PyYAML, prometheus-client and
# nvidia-ml-py), at the versions the agent's image locks, into .whl (ignored by git). Then run
# the suite there with `bash devtools/gpu-suite.sh`, carrying .whl (docs/real-driver.md).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
locked() { sed -n "s/^$1==\([^ ]*\) .*/\1/p" nodeagent/requirements.lock; }
rm -rf .whl && mkdir .whl
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions h2 hpack hyperframe; do
  version=$(locked "$name")
  [ -n "$version" ] || { echo "gpu-wheels: $name is not in nodeagent/requirements.lock" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
ls .whl
