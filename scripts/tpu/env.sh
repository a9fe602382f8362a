#!/usr/bin/env bash
# Settings shared by the Cloud TPU scripts (sourced by create.sh, install.sh, launch.sh, logs.sh).
# Every value can be overridden from the environment, e.g. `TPU_NAME=sao-256 ACCELERATOR=v5p-256 ...`.
# NOT RUN HERE: these scripts were written without access to a TPU; they are checked only with bash -n,
# --help, shellcheck and a stub gcloud (tests/test_memory_plan.py).
set -euo pipefail

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "usage: source scripts/tpu/env.sh   (settings for the other scripts; nothing to run)"
  exit 0
fi

TPU_NAME="${TPU_NAME:-sao-v5p-64}"
ZONE="${ZONE:-us-east5-a}"                     # a zone where your project has v5p quota
PROJECT="${PROJECT:-}"                         # empty: gcloud's configured project
ACCELERATOR="${ACCELERATOR:-v5p-64}"           # v5p-N = N TensorCores = N/2 chips = N/8 hosts
RUNTIME_VERSION="${RUNTIME_VERSION:-v2-alpha-tpuv5}"  # the v5p TPU VM image for JAX (Cloud TPU docs)
SPOT="${SPOT:-0}"                              # 1: a Spot slice (cheaper, preemptible; deleted and recreated on preemption)
BUCKET="${BUCKET:-gs://YOUR_BUCKET}"           # holds checkpoints in, prompt files, run outputs
MOUNT_POINT="${MOUNT_POINT:-/mnt/gcs}"         # where install.sh mounts BUCKET on every worker (Cloud Storage FUSE)
REMOTE_DIR="${REMOTE_DIR:-\$HOME/sao_jax}"     # the code on each worker (expanded there)
REMOTE_VENV="${REMOTE_VENV:-\$HOME/sao-venv}"  # its virtual environment (expanded there)
REMOTE_LOGS="${REMOTE_LOGS:-\$HOME/sao-logs}"  # per-host logs (expanded there)
JAX_VERSION="${JAX_VERSION:-0.10.2}"           # the version the test suite ran with
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"
POLL_S="${POLL_S:-30}"                         # seconds between state checks and between relaunches

# Flags every gcloud TPU command takes.
GCLOUD_FLAGS=(--zone="$ZONE")
if [[ -n "$PROJECT" ]]; then
  GCLOUD_FLAGS+=(--project="$PROJECT")
fi

# Number of hosts (VMs) of the slice: v5p has 4 chips = 8 TensorCores per host.
num_hosts() {
  local cores="${ACCELERATOR##*-}"
  echo $(( cores < 8 ? 1 : cores / 8 ))
}

# State of the slice: READY, CREATING, PREEMPTED, ...; empty when it does not exist.
tpu_state() {
  gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --format='value(state)' 2>/dev/null || true
}

# Run a shell command on every worker of the slice.
on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --worker=all --command="$1"
}
