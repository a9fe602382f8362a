#!/usr/bin/env bash
# Create the TPU VM slice, or reuse it if it is already there (idempotent).
# NOT RUN HERE: written without access to a TPU; checked only with bash -n, --help, shellcheck and a
# stub gcloud (tests/test_memory_plan.py).
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

usage() {
  cat <<USAGE
usage: scripts/tpu/create.sh [--recreate]

Creates the slice \$TPU_NAME ($TPU_NAME: $ACCELERATOR, image $RUNTIME_VERSION, zone $ZONE${PROJECT:+, project $PROJECT})
or reuses it when it is READY; waits while it is being created or repaired. A slice that was
PREEMPTED or TERMINATED is deleted and created again (a Spot slice cannot be restarted in place).
  --recreate   delete and create the slice even if it is READY
Settings come from scripts/tpu/env.sh (override them in the environment; SPOT=1 for a Spot slice).
USAGE
}

recreate=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --recreate) recreate=1; shift ;;
    *) echo "create.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

create() {
  local spot_flags=()
  if [[ "$SPOT" == 1 ]]; then
    spot_flags=(--spot)
  fi
  echo "creating $TPU_NAME ($ACCELERATOR, $RUNTIME_VERSION)"
  gcloud compute tpus tpu-vm create "$TPU_NAME" "${GCLOUD_FLAGS[@]}" \
    --accelerator-type="$ACCELERATOR" --version="$RUNTIME_VERSION" "${spot_flags[@]}"
}

delete() {
  echo "deleting $TPU_NAME"
  gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --quiet
}

state="$(tpu_state)"
if [[ "$recreate" == 1 && -n "$state" ]]; then
  delete
  state=""
fi
while true; do
  case "$state" in
    READY) echo "$TPU_NAME is READY ($(num_hosts) hosts)"; exit 0 ;;
    "") create ;;
    CREATING|STARTING|RESTARTING|REPAIRING) echo "$TPU_NAME is $state; waiting"; sleep "$POLL_S" ;;
    PREEMPTED|TERMINATED|STOPPED) delete ;;
    *) echo "create.sh: $TPU_NAME is in state $state; not touching it" >&2; exit 1 ;;
  esac
  state="$(tpu_state)"
done
