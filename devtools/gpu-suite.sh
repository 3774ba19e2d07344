#!/usr/bin/env bash
# The real-GPU suite (tests/gpu) on a GPU machine, as root, without the project's virtualenv:
# the wheels devtools/gpu-wheels.sh fetched into .whl are installed into /tmp/site first.
# Then the agent's cycle on the real driver beside the calls it cannot avoid
# (benchmarks/agent_cycle_gpu.py; GPUUSAGE_GPU_BENCH below), and, where GPUUSAGE_MODEL_BENCH
# asks, the driver model's benchmark (benchmarks/agent_cycle.py: 8 GPUs x 64, which one GPU
# cannot show) on the same CPU. Arguments go to pytest (say --timeout 180).
# Figures go to $GPUUSAGE_GPU_FIGURES (default: gpu-figures.json, or $OUT/ where that is set)
# and the benchmark's beside it; the exit status is the suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G '.whl/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
roots="$PWD/src:$PWD/nodeagent:$PWD/operator:$PWD/commands:$PWD/devtools:$PWD"
export PYTHONPATH="$roots${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GPUUSAGE_GPU_FIGURES="${GPUUSAGE_GPU_FIGURES:-${OUT:-.}/gpu-figures.json}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
uname -r; python3 --version
# tests/conftest.py (the control plane's fixtures) is not needed here: stop at tests/gpu.
status=0
python3 -m pytest -m gpu tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -v "$@" || status=$?
# GPUUSAGE_GPU_BENCH: the benchmark's runs, argument lists separated by ';' (each run's
# figures to agent-cycle-gpu-<n>.json); unset: one run with its defaults; 'none': no run.
IFS=';' read -r -a runs <<<"${GPUUSAGE_GPU_BENCH-}"
[ "${#runs[@]}" -gt 0 ] || runs=("")
[ "${GPUUSAGE_GPU_BENCH-}" != none ] || runs=()
n=0
for run in "${runs[@]}"; do
  n=$((n + 1))
  # shellcheck disable=SC2086 # each run's arguments are split on purpose
  python3 benchmarks/agent_cycle_gpu.py $run \
    --output "$(dirname "$GPUUSAGE_GPU_FIGURES")/agent-cycle-gpu-$n.json" || true
done
# GPUUSAGE_MODEL_BENCH: the model benchmark's runs, as above (to agent-cycle-model-<n>.json);
# unset or empty: none.
IFS=';' read -r -a models <<<"${GPUUSAGE_MODEL_BENCH-}"
n=0
for run in "${models[@]}"; do
  n=$((n + 1))
  # shellcheck disable=SC2086 # each run's arguments are split on purpose
  python3 benchmarks/agent_cycle.py $run \
    --output "$(dirname "$GPUUSAGE_GPU_FIGURES")/agent-cycle-model-$n.json" || true
done
exit "$status"
