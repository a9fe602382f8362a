#!/usr/bin/env bash
# Ship this repository to every worker of the slice and install it with jax[tpu] in a virtualenv.
# NOT RUN HERE: written without access to a TPU; checked only with bash -n, --help, shellcheck and a
# stub gcloud (tests/test_memory_plan.py).
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

usage() {
  cat <<USAGE
usage: scripts/tpu/install.sh [--mount] [--model gs://BUCKET/PATH/TO/HF_FOLDER]

On every worker of $TPU_NAME (--worker=all):
  1. unpack the committed tree of this repository (git archive HEAD) into $REMOTE_DIR
  2. create $REMOTE_VENV with Python $PYTHON_VERSION (uv) and pip install -e the repo (with gcsfs, for
     gs:// output_dir) + jax[tpu]==$JAX_VERSION
  --mount   install Cloud Storage FUSE and mount $BUCKET at $MOUNT_POINT (output_dir, prompt files)
  --model   copy a Hugging Face model folder from GCS to ~/models/<name> on each worker's disk
Safe to run again (after a code change, or on a recreated slice).
USAGE
}

mount=0
model=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --mount) mount=1; shift ;;
    --model) model="${2:?--model needs a gs:// path}"; shift 2 ;;
    *) echo "install.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
if [[ -n "$(git -C "$repo_root" status --porcelain --untracked-files=no)" ]]; then
  echo "install.sh: warning: uncommitted changes are NOT shipped (git archive HEAD)" >&2
fi
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
archive="$staging/sao_jax.tar.gz"
git -C "$repo_root" archive --format=tar.gz -o "$archive" HEAD
gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME":/tmp/sao_jax.tar.gz "${GCLOUD_FLAGS[@]}" --worker=all

on_all_workers "
set -euo pipefail
rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR $REMOTE_LOGS
tar -xzf /tmp/sao_jax.tar.gz -C $REMOTE_DIR
# pip refuses --user installs on images whose Python is externally managed (PEP 668) unless told.
python3 -m pip install --user --quiet --upgrade uv || python3 -m pip install --user --quiet --upgrade --break-system-packages uv
export PATH=\$HOME/.local/bin:\$PATH
[[ -x $REMOTE_VENV/bin/python ]] || uv venv --python $PYTHON_VERSION $REMOTE_VENV
uv pip install --python $REMOTE_VENV/bin/python -e '$REMOTE_DIR[gcs]' 'jax[tpu]==$JAX_VERSION'
$REMOTE_VENV/bin/python -c 'import jax; print(jax.process_index(), \"local devices:\", jax.local_devices())'
"

if [[ "$mount" == 1 ]]; then
  bucket_name="${BUCKET#gs://}"
  on_all_workers "
set -euo pipefail
if ! command -v gcsfuse >/dev/null; then
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" \
    | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  sudo apt-get update -qq && sudo apt-get install -y -qq gcsfuse
fi
sudo mkdir -p $MOUNT_POINT && sudo chown \$USER $MOUNT_POINT
mountpoint -q $MOUNT_POINT || gcsfuse --implicit-dirs ${bucket_name%%/*} $MOUNT_POINT
"
fi

if [[ -n "$model" ]]; then
  on_all_workers "
set -euo pipefail
mkdir -p \$HOME/models
gcloud storage cp -r '$model' \$HOME/models/
df -h \$HOME/models
"
fi
echo "installed on $(num_hosts) hosts of $TPU_NAME"
