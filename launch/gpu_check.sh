#!/usr/bin/env bash
# One-GPU check of the train step (llm_jax/bench/gpu_check.py): tokens/s, MFU, kernels, < 10 min.
# Runs the step twice: as `auto` chooses, then with the Pallas-Triton kernels (flash attention
# with sinks, the grouped-matmul MoE), so one run shows whether they should become the default.
#   bash launch/gpu_check.sh [--batch 8 --seq_len 2048 --steps 10 | --quick]
# Needs `pip install -e . 'jax[cuda12]==0.10.2'`. Not yet run on a GPU (written without one).
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
echo "== auto"
timeout 300 python -m llm_jax.bench.gpu_check "$@"
echo "== Pallas kernels: --attention_impl flash --moe_dispatch gmm"
timeout 300 python -m llm_jax.bench.gpu_check --attention_impl flash --moe_dispatch gmm "$@"
