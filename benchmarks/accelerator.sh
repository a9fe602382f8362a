#!/usr/bin/env bash
# The checks an accelerator session runs first (one H200: meant to fit 8 minutes end to end, not yet
# timed): where the ~1B bf16 MoE's training step loses its FLOPs, then SAO's updates at the fastest
# dispatch. 1) benchmarks/model.py --moe-1b prints one table, a row per dispatch — the dense twin,
# capacity, sorted (`ragged_dot`, XLA's lowering), on a GPU sorted through JAX's Pallas Triton grouped
# matmul, on a TPU the megablox kernel (gmm) — with the FLOPs XLA compiled over the model FLOPs, ms
# per step and MFU against PEAK; 2) benchmarks/train_step.py times the value, policy and ttur_step
# (K=2) updates with the fastest of those dispatches. Both at BATCHxSEQ with remat.
# Usage: bash benchmarks/accelerator.sh [--smoke] [BATCHxSEQ] [PEAK_TFLOPS]   (default 16x1024, 989 = H200 bf16)
#   --smoke: the tiny preset, one repeat, on whatever backend there is (a CPU check of this script)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # sao_jax from this checkout, installed or not
smoke=0
if [[ "${1:-}" == "--smoke" ]]; then smoke=1; shift; fi
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,10p' "$0"; exit 0; fi
shape=${1:-16x1024}
peak=${2:-989}
python=${PYTHON:-python}
if ((smoke)); then
    shape=${1:-2x32}
    model_args=(--smoke --repeats 1)
    step_args=(--preset d512 --quick --repeats 1)
else
    model_args=(--repeats 3)
    step_args=(--preset moe_1b --repeats 3)
fi
table=$(mktemp)
trap 'rm -f "$table"' EXIT
"$python" benchmarks/model.py --moe-1b "$shape" --peak-tflops "$peak" "${model_args[@]}" | tee "$table"
read -r dispatch lowering < <(sed -n 's/^fastest dispatch: //p' "$table")
triton=()
if [[ "${lowering:-}" == triton ]]; then triton=(--ragged-dot-triton); fi
echo
"$python" benchmarks/train_step.py "${step_args[@]}" --dispatch "$dispatch" "${triton[@]}" --batch "${shape%x*}" \
    --seq "${shape#*x}" --remat --no-tunix --frozen-only --peak-tflops "$peak"
