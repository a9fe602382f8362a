#!/usr/bin/env bash
# The checks a GPU session should run first (estimated ~10 minutes on one H200, not yet timed): where the ~1B bf16 MoE's
# step loses its FLOPs. On 2026-11-30 it reached 2 % MFU with the sorted dispatch (`ragged_dot`), whose
# default XLA lowering may pad every expert's group to the whole batch. model.py prints, per dispatch,
# the FLOPs XLA compiled over the model FLOPs and the step time against a dense twin (adding the sorted
# dispatch through JAX's Pallas Triton grouped matmul); train_step.py then times SAO's updates with it.
# Usage: bash benchmarks/gpu_moe.sh [BATCHxSEQ]   (default 16x1024)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # sao_jax from this checkout, installed or not
shape=${1:-16x1024}
python benchmarks/model.py --moe-1b "$shape" --repeats 3
python benchmarks/train_step.py --preset moe_1b --dispatch sorted --ragged-dot-triton --batch "${shape%x*}" \
    --seq "${shape#*x}" --remat --no-tunix --frozen-only --peak-tflops 989 --repeats 3
