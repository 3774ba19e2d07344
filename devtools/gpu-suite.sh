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
# run_each SCRIPT NAME LIST: the benchmark SCRIPT once per argument list in LIST (separated
# by ';'; an empty list between them: its defaults), each run's figures to NAME-<n>.json
# beside the suite's.
run_each() {
  local script=$1 name=$2 n=0 run
  local -a lists
  IFS=';' read -r -a lists <<<"$3"
  for run in "${lists[@]}"; do
    n=$((n + 1))
    # shellcheck disable=SC2086 # each run's arguments are split on purpose
    python3 "$script" $run --output "$(dirname "$GPUUSAGE_GPU_FIGURES")/$name-$n.json" || true
  done
}
# GPUUSAGE_GPU_BENCH: the real-GPU benchmark's runs; unset: one run with its defaults;
# 'none': no run.
gpu_runs=${GPUUSAGE_GPU_BENCH-;}
[ "$gpu_runs" != none ] || gpu_runs=
run_each benchmarks/agent_cycle_gpu.py agent-cycle-gpu "$gpu_runs"
# GPUUSAGE_MODEL_BENCH: the model benchmark's runs; unset or empty: none.
run_each benchmarks/agent_cycle.py agent-cycle-model "${GPUUSAGE_MODEL_BENCH-}"
exit "$status"
