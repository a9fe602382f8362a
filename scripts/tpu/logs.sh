#!/usr/bin/env bash
# Fetch (or follow) the per-host logs of a run started by launch.sh.
# NOT RUN HERE: written without access to a TPU; checked only with bash -n, --help, shellcheck and a
# stub gcloud (tests/test_memory_plan.py).
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

RUN_NAME="${RUN_NAME:-v5p-64}"  # the --name of launch.sh (default there: the config's file name)
TAIL_LINES="${TAIL_LINES:-200}"

usage() {
  cat <<USAGE
usage: scripts/tpu/logs.sh [--name RUN] [--lines N] [--follow] [--worker I]

Copies the last N lines (default $TAIL_LINES) of $REMOTE_LOGS/<run>.log from each of the $(num_hosts)
hosts of $TPU_NAME to logs/tpu/<run>/worker-<i>.log here; with --follow, streams the log of one
host instead (--worker, default 0).
Metrics are not here: they are in <output_dir>/metrics.jsonl and <output_dir>/tensorboard/.
USAGE
}

follow=0
worker=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --name) RUN_NAME="$2"; shift 2 ;;
    --lines) TAIL_LINES="$2"; shift 2 ;;
    --follow) follow=1; shift ;;
    --worker) worker="$2"; shift 2 ;;
    *) echo "logs.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

log="$REMOTE_LOGS/$RUN_NAME.log"
if [[ "$follow" == 1 ]]; then
  exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --worker="$worker" --command="tail -n $TAIL_LINES -F $log"
fi
local_logs="logs/tpu/$RUN_NAME"
mkdir -p "$local_logs"
for (( i = 0; i < $(num_hosts); i++ )); do
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --worker="$i" \
    --command="tail -n $TAIL_LINES $log" > "$local_logs/worker-$i.log" || echo "worker $i: no log yet" >&2
done
echo "wrote $local_logs/worker-*.log"
