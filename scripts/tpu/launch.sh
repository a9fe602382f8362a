#!/usr/bin/env bash
# Run `sao-train` on every host of the slice; after a preemption or crash, recreate/reinstall as
# needed and relaunch with --resume (the run continues from its newest checkpoint in output_dir,
# which after a preemption's SIGTERM is the step that was in hand).
# NOT RUN HERE: written without access to a TPU; checked only with bash -n, --help, shellcheck and a
# stub gcloud (tests/test_memory_plan.py).
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

CONFIG="${CONFIG:-configs/pods/v5p-64.yaml}"  # relative to the repository root
RUN_NAME="${RUN_NAME:-}"                       # default: the config's file name
OUTPUT_DIR="${OUTPUT_DIR:-}"                   # default: $MOUNT_POINT/runs/$RUN_NAME = $BUCKET/runs/$RUN_NAME via FUSE
MAX_RESTARTS="${MAX_RESTARTS:-20}"
INSTALL_FLAGS="${INSTALL_FLAGS:---mount}"     # install.sh flags for a recreated slice (add --model gs://...)

usage() {
  cat <<USAGE
usage: scripts/tpu/launch.sh [--config FILE] [--name RUN] [--output-dir DIR] [--max-restarts N] [-- key=value ...]

Runs on all $(num_hosts) hosts of $TPU_NAME:  sao-train --distributed --config \$CONFIG --resume output_dir=\$OUTPUT_DIR key=value ...
  --config        run config, relative to the repo root (default $CONFIG)
  --name          run name (default: the config's file name): logs go to $REMOTE_LOGS/<name>.log
                  on each host and, streamed, to logs/tpu/<name>/attempt-<n>.log here
  --output-dir    where checkpoints, metrics.jsonl, tensorboard/ and plots/ go; must be the same
                  path on every host (default $MOUNT_POINT/runs/<name>: the bucket mounted by
                  install.sh --mount, i.e. $BUCKET/runs/<name>), or a gs:// URL, which needs no
                  mount (files go through a local mirror, pushed at each checkpoint)
  --max-restarts  relaunches after a failure before giving up (default $MAX_RESTARTS)
--resume is always passed: with no checkpoint in output_dir the run starts from the beginning.
After a failure: a slice that is no longer READY (preempted) is recreated (create.sh --recreate)
and reinstalled (install.sh \$INSTALL_FLAGS, now: $INSTALL_FLAGS); then the job is started again.
USAGE
}

overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --name) RUN_NAME="$2"; shift 2 ;;
    --output-dir) OUTPUT_DIR="$2"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --) shift; overrides=("$@"); break ;;
    *) echo "launch.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

RUN_NAME="${RUN_NAME:-$(basename "$CONFIG" .yaml)}"
OUTPUT_DIR="${OUTPUT_DIR:-$MOUNT_POINT/runs/$RUN_NAME}"
local_logs="logs/tpu/$RUN_NAME"
here="$(dirname "${BASH_SOURCE[0]}")"
log="$REMOTE_LOGS/$RUN_NAME.log"
pidfile="$REMOTE_LOGS/$RUN_NAME.pid"
quoted_overrides=""
if (( ${#overrides[@]} )); then
  quoted_overrides="$(printf ' %q' "${overrides[@]}")"
fi

# Each host: stop this run's previous process if one survived (it would hold the TPU): SIGTERM, on
# which sao-train saves the step in hand and exits within train.signal_grace_s (25 s), and SIGKILL
# after 30 s. Then start sao-train in the foreground with its output appended to the host's log; the
# PID file lets the next attempt stop exactly that process. sao-train exits 0 only when the run is
# finished: 143 after a preemption's SIGTERM (the step in hand saved), so the loop below resumes.
job="
set -euo pipefail
mkdir -p $REMOTE_LOGS
if [[ -f $pidfile ]]; then
  old=\$(cat $pidfile)
  if ps -p \$old -o args= | grep -q sao-train; then
    kill \$old
    for _ in \$(seq 30); do kill -0 \$old 2>/dev/null || break; sleep 1; done
    kill -9 \$old 2>/dev/null || true
  fi
fi
cd $REMOTE_DIR
exec > >(tee -a $log) 2>&1
echo \"=== \$(date -u +%FT%TZ) host \$(hostname) starts $RUN_NAME\"
echo \$\$ > $pidfile
exec $REMOTE_VENV/bin/sao-train --distributed --config $CONFIG --resume output_dir=$OUTPUT_DIR$quoted_overrides
"

mkdir -p "$local_logs"
attempt=0
while true; do
  attempt=$((attempt + 1))
  echo "=== attempt $attempt: $RUN_NAME on $TPU_NAME, output_dir=$OUTPUT_DIR" | tee -a "$local_logs/attempt-$attempt.log"
  if on_all_workers "$job" 2>&1 | tee -a "$local_logs/attempt-$attempt.log"; then
    echo "=== $RUN_NAME finished"
    exit 0
  fi
  if (( attempt > MAX_RESTARTS )); then
    echo "launch.sh: giving up after $attempt attempts; see $local_logs" >&2
    exit 1
  fi
  state="$(tpu_state)"
  echo "=== attempt $attempt failed; $TPU_NAME is ${state:-gone}"
  if [[ "$state" != READY ]]; then
    "$here/create.sh" --recreate
    # shellcheck disable=SC2086 # INSTALL_FLAGS is a list of flags
    "$here/install.sh" $INSTALL_FLAGS
  fi
  sleep "$POLL_S"
done
