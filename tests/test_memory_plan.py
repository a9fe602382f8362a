"""scripts/memory_plan.py against bytes counted by hand for `tiny_qwen3_moe`, and the Cloud TPU files.

tiny_qwen3_moe: vocab V=97, d=32, L=2 layers (layer 0 dense F=48, layer 1 MoE: E=4 experts, top k=2,
f=16), h=4 heads, kv=2 KV heads, head_dim 8, q/k norm, no biases, untied LM head, compute float32.
Parameter elements, written out from the architecture (not from the code under test):
  embed/embedding            V·d           = 97·32          = 3104   (vocab, embed)
  per layer: 2 norms         2d            = 64                      (replicated)
             q, o            2·d·h·hd      = 2·32·4·8       = 2048   (embed/heads)
             k, v            2·d·kv·hd     = 2·32·2·8       = 1024   (embed/kv_heads)
             q/k norm        2·hd          = 16                      (replicated)
  layer 0 dense MLP          3·d·F         = 3·32·48        = 4608   (embed, mlp)
  layer 1 router             d·E           = 32·4           = 128    (embed, expert)
  layer 1 experts            3·E·d·f       = 3·4·32·16      = 6144   (expert, embed, mlp)
  final_norm                 d             = 32
  lm_head (policy)           d·V           = 3104
  value_head (critic, f32)   d + 1         = 33
"""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import yaml

from sao_jax.config import MeshConfig, load_config
from sao_jax.models import tiny_qwen3_moe

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "memory_plan.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("memory_plan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


mp = _load_script()

LAYER_COMMON = 64 + 2048 + 1024 + 16  # norms, q+o, k+v, q/k norm = 3152
TRUNK = 3104 + 2 * LAYER_COMMON + 4608 + 128 + 6144 + 32  # = 20320
POLICY = TRUNK + 3104  # = 23424
CRITIC_BF16 = TRUNK  # stored in the weights dtype
VALUE_HEAD = 33  # always float32
CRITIC_FROZEN_TRAINABLE_BF16 = 128 + 6144  # router + routed experts (the dense layer-0 MLP stays frozen)

# Per chip on mesh data=2, fsdp=2, expert=2, tensor=1: "embed" is halved by fsdp, "expert" by expert.
MESH = {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
LAYER_COMMON_CHIP = 64 + 2048 // 2 + 1024 // 2 + 16  # = 1616
TRUNK_CHIP = 3104 // 2 + 2 * LAYER_COMMON_CHIP + 4608 // 2 + 128 // 4 + 6144 // 4 + 32  # = 8688
POLICY_CHIP = TRUNK_CHIP + 3104 // 2  # = 10240
VALUE_HEAD_CHIP = 16 + 1
FROZEN_TRAINABLE_CHIP = 128 // 4 + 6144 // 4
ADAM_COUNT = 4  # the int32 step count of scale_by_adam (replicated)


def _tiny(**changes):
    """The tiny preset's plan on MESH; `changes` override the workload."""
    settings = dict(chips=8, weights="bfloat16", master_f32=True, rollout_batch=4, rollout_tokens=16,
                    train_seq_len=16, micro_batch=4, train_batch=8)  # fmt: skip
    return mp.plan(tiny_qwen3_moe(), MESH, **{**settings, **changes})


@pytest.fixture(scope="module")
def tiny_plan():
    return _tiny()


def test_parameter_counts_match_the_architecture(tiny_plan):
    assert tiny_plan["policy"]["params"] == POLICY
    assert tiny_plan["critic"]["params"] == CRITIC_BF16 + VALUE_HEAD
    assert tiny_plan["critic"]["trainable_params"] == CRITIC_FROZEN_TRAINABLE_BF16 + VALUE_HEAD
    assert tiny_plan["critic"]["all_trainable"]["trainable_params"] == CRITIC_BF16 + VALUE_HEAD


def test_bf16_weights_with_f32_master(tiny_plan):
    policy, critic = tiny_plan["policy"], tiny_plan["critic"]
    assert policy["weights"] == {"total": 2 * POLICY, "per_chip": 2 * POLICY_CHIP}
    assert critic["weights"] == {"total": 2 * CRITIC_BF16 + 4 * VALUE_HEAD, "per_chip": 2 * TRUNK_CHIP + 4 * VALUE_HEAD_CHIP}
    # f32 master of trainable bf16 leaves; gradients and AdamW moments (mu, nu) in f32.
    assert policy["master"] == {"total": 4 * POLICY, "per_chip": 4 * POLICY_CHIP}
    assert policy["grads"] == {"total": 4 * POLICY, "per_chip": 4 * POLICY_CHIP}
    assert policy["optimizer"] == {"total": 8 * POLICY + ADAM_COUNT, "per_chip": 8 * POLICY_CHIP + ADAM_COUNT}


def test_frozen_attention_critic_holds_state_only_for_moe_and_value_head(tiny_plan):
    critic = tiny_plan["critic"]
    trainable = CRITIC_FROZEN_TRAINABLE_BF16 + VALUE_HEAD
    trainable_chip = FROZEN_TRAINABLE_CHIP + VALUE_HEAD_CHIP
    assert critic["master"] == {"total": 4 * CRITIC_FROZEN_TRAINABLE_BF16, "per_chip": 4 * FROZEN_TRAINABLE_CHIP}
    assert critic["grads"] == {"total": 4 * trainable, "per_chip": 4 * trainable_chip}
    assert critic["optimizer"] == {"total": 8 * trainable + ADAM_COUNT, "per_chip": 8 * trainable_chip + ADAM_COUNT}
    everything = critic["all_trainable"]
    assert everything["optimizer"]["total"] == 8 * (CRITIC_BF16 + VALUE_HEAD) + ADAM_COUNT
    assert everything["master"]["total"] == 4 * CRITIC_BF16
    # What freezing saves: the AdamW moments of attention, embeddings, norms and the dense MLP.
    assert everything["optimizer"]["total"] - critic["optimizer"]["total"] == 8 * (CRITIC_BF16 - CRITIC_FROZEN_TRAINABLE_BF16)


def test_without_master_gradients_and_moments_take_the_weights_dtype():
    p = mp.plan(tiny_qwen3_moe(), MESH, chips=8, weights="bfloat16", master_f32=False, rollout_batch=4,
                rollout_tokens=16, train_seq_len=16, micro_batch=4, train_batch=8)  # fmt: skip
    critic = p["critic"]
    grads = 2 * CRITIC_FROZEN_TRAINABLE_BF16 + 4 * VALUE_HEAD
    assert critic["master"]["total"] == 0
    assert critic["grads"]["total"] == grads
    assert critic["optimizer"]["total"] == 2 * grads + ADAM_COUNT


def test_f32_weights_hold_gradients_and_moments_in_f32_without_a_master():
    p = mp.plan(tiny_qwen3_moe(), MESH, chips=8, weights="float32", master_f32=False, rollout_batch=4,
                rollout_tokens=16, train_seq_len=16, micro_batch=4, train_batch=8)  # fmt: skip
    policy = p["policy"]
    assert policy["weights"]["total"] == 4 * POLICY and policy["master"]["total"] == 0
    assert policy["grads"]["total"] == 4 * POLICY
    assert policy["optimizer"]["total"] == 8 * POLICY + ADAM_COUNT
    with pytest.raises(ValueError, match="master_f32 needs bfloat16"):
        mp.plan(tiny_qwen3_moe(), MESH, chips=8, weights="float32", master_f32=True)


ROPE_TABLE = 2 * 16 * 4 * 4  # (cos, sin) · T · rotary_dim/2 (hd 8) · float32, on every chip


def test_kv_cache_bytes_and_per_chip_division(tiny_plan):
    # 2 (K, V) · L · B · T · kv · hd · 4 bytes (float32 compute) + lengths int32[B]; B=4, T=16.
    kv_total = 2 * 2 * 4 * 16 * 2 * 8 * 4 + 4 * 4
    assert tiny_plan["kv_cache"]["total"] == kv_total + ROPE_TABLE
    # batch over data·fsdp = 4: one sequence per chip; kv heads unsplit (tensor=1).
    assert tiny_plan["kv_cache"]["per_chip"] == 2 * 2 * 1 * 16 * 2 * 8 * 4 + 4 + ROPE_TABLE
    assert tiny_plan["kv_bytes_per_sequence"] == (kv_total + ROPE_TABLE) // 4


def test_kv_cache_splits_kv_heads_over_tensor():
    mesh = mp.resolve_mesh({"data": 2, "tensor": 2}, 4)
    kv = mp.kv_cache_bytes(tiny_qwen3_moe(), batch=4, max_len=16, mesh=mesh)
    assert kv["per_chip"] == 2 * 2 * 2 * 16 * 1 * 8 * 4 + 2 * 4 + ROPE_TABLE  # 2 sequences, 1 of 2 kv heads


def test_activations_with_full_remat(tiny_plan):
    # b = 4 sequences / (data·fsdp = 4) = 1 per chip, T = 16, c = 4 bytes, t = 1, x = 2 expert shards.
    kept = 2 * 1 * 16 * 32 * 4  # L · b · T · d · c
    e_attn = 3 * 32 + (2 * 4 + 2 * 2) * 8
    e_moe = 2 * 32 + 2 * 4 * 4 / 4 + 2 / 2 * (2 * 32 + 3 * 16)
    e_dense = 2 * 32 + 3 * 48
    layer = 1 * 16 * 4 * (e_attn + max(e_moe, e_dense))
    logits = 2 * 1 * 16 * 97 * 4
    policy, critic = tiny_plan["policy"]["activations"], tiny_plan["critic"]["activations"]
    assert (policy["kept"], policy["layer"], policy["logits"]) == (kept, layer, logits)
    assert critic["logits"] == 0 and critic["total"] == kept + layer
    # train_batch 8 > micro_batch 4: gradients held twice (accumulator + current micro-batch).
    assert tiny_plan["policy"]["transient_per_chip"] == 2 * 4 * POLICY_CHIP + kept + layer + logits


def test_flops_count_matmul_parameters_per_token(tiny_plan):
    attention = 2 * (2048 + 1024)  # q, k, v, o of both layers
    routed_active = 6144 * 2 // 4  # k/E of the routed experts
    n_policy = attention + 4608 + 128 + routed_active + 3104
    n_critic = n_policy - 3104
    n_critic_train = 128 + routed_active
    assert tiny_plan["policy"]["matmul_params_per_token"] == n_policy
    assert tiny_plan["critic"]["trainable_matmul_params_per_token"] == n_critic_train
    tokens, seq = 8 * 16, 16
    attention_train = 6 * 2 * 4 * 8 * seq * tokens
    critic_update = (4 * n_critic + 2 * n_critic_train) * tokens + attention_train
    policy_update = 6 * n_policy * tokens + attention_train
    critic_forward = 2 * n_critic * tokens + 2 * 2 * 4 * 8 * seq * tokens
    assert tiny_plan["flops"]["rl_step"] == pytest.approx(2 * critic_update + critic_forward + policy_update)
    chip = mp.CHIPS["v5p"]
    assert tiny_plan["rl_step_s"] == pytest.approx(tiny_plan["flops"]["rl_step"] / (8 * chip.peak_bf16_flops * 0.4))
    rollout = 2 * n_policy * 4 * 16 + 2 * 2 * 4 * 8 * 16**2 * 4
    assert tiny_plan["flops"]["rollout"] == pytest.approx(rollout)


def test_decode_bandwidth_bound(tiny_plan):
    # In place on the train mesh: every weight with an "embed" dimension is fsdp-sharded and must be
    # all-gathered each step (per-chip bytes · (fsdp − 1)); only the norms are replicated.
    norms = 2 * (64 + 16) + 32
    gathered = 2 * (POLICY_CHIP - norms) * (2 - 1)
    assert tiny_plan["decode_step_bytes_gathered"] == gathered
    # b = ceil(4 sequences / (data·fsdp)) = 1 token per replica per step hits 1 − (1 − 2/4)¹ of the experts.
    experts = 2 * (6144 // 4)
    step = 2 * POLICY_CHIP - experts + 0.5 * experts + tiny_plan["kv_cache"]["per_chip"] / 2
    assert tiny_plan["decode_step_bytes_read"] == pytest.approx(step)
    chip = mp.CHIPS["v5p"]
    expected = 16 * max(step / chip.hbm_bytes_per_s, gathered / chip.ici_bytes_per_s)
    assert tiny_plan["rollout_bandwidth_s"] == pytest.approx(expected)


def test_disjoint_rollout_submesh_and_peaks():
    # f32 weights, bf16 compute: the rollout copy is cast to bf16 as it is resharded.
    p = mp.plan(tiny_qwen3_moe(dtype="bfloat16"), {"fsdp": -1}, chips=8, weights="float32", rollout_chips=2,
                rollout_mesh_shape={"tensor": 2}, rollout_batch=4, rollout_tokens=16, train_seq_len=16,
                train_batch=8)  # fmt: skip
    assert p["mesh"] == {"data": 1, "fsdp": 6, "expert": 1, "tensor": 1} and p["train_chips"] == 6
    assert set(p["chip_peaks"]) == {"train", "rollout"}
    assert p["chip_peaks"]["rollout"] == p["rollout_weights_copy_per_chip"] + p["kv_cache"]["per_chip"]
    # Policy weights on tensor=2: heads, kv heads, mlp and vocab halved, the rest (norms, router) whole;
    # vocab 97 is odd, so embedding and LM head hold ceil(97/2) = 49 rows each.
    per_chip = 2 * 49 * 32 + 2 * (64 + 2048 // 2 + 1024 // 2 + 16) + 4608 // 2 + 128 + 6144 // 2 + 32
    assert p["rollout_weights_copy_per_chip"] == 2 * per_chip
    # The train mesh's fsdp=6 does not divide d=32: every leaf with an "embed" dimension is uneven.
    assert {"embed/embedding", "lm_head/kernel"} <= set(p["policy"]["uneven"])
    assert "final_norm/scale" not in p["policy"]["uneven"]


def test_shard_shape_follows_default_rules():
    mesh = {"data": 2, "fsdp": 4, "expert": 8, "tensor": 2}
    assert mp.shard_shape((128, 2048, 768), ("expert", "embed", "mlp"), mesh) == ((16, 512, 384), True)
    # "batch" takes data and fsdp, so "embed" of the same array is not split again.
    assert mp.shard_shape((16, 10, 2048), ("batch", "length", "embed"), mesh) == ((2, 10, 2048), True)
    assert mp.shard_shape((4, 128), ("kv_heads", "head_dim"), {**mesh, "tensor": 8}) == ((1, 128), False)


def test_mesh_and_accelerator_parsing():
    assert mp.accelerator_chips("v5p-64")[1] == 32  # v5p-N counts TensorCores, two per chip
    assert mp.accelerator_chips("v5p-256")[1] == 128
    with pytest.raises(ValueError, match="unknown accelerator"):
        mp.accelerator_chips("v9-8")
    assert mp.parse_mesh("data=2, fsdp=-1") == {"data": 2, "fsdp": -1}
    with pytest.raises(ValueError, match="AXIS=SIZE"):
        mp.parse_mesh("model=2")
    assert mp.resolve_mesh({"expert": 4, "fsdp": -1}, 32) == {"data": 1, "fsdp": 8, "expert": 4, "tensor": 1}
    with pytest.raises(ValueError, match="has 16 positions but there are 32 devices"):
        mp.resolve_mesh({"fsdp": 16}, 32)


def test_cli_markdown_json_and_errors(capsys):
    args = ["--preset", "tiny_qwen3_moe", "--chips", "8", "--mesh", "data=2,fsdp=2,expert=2",
            "--rollout-batch", "4", "--rollout-tokens", "16", "--train-seq-len", "16", "--train-batch", "8"]  # fmt: skip
    assert mp.main([*args, "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "| AdamW state |" in markdown and "**peak, shared chip**" in markdown
    assert mp.main([*args, "--json", "--critic", "all-trainable"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["critic"]["trainable_params"] == CRITIC_BF16 + VALUE_HEAD
    assert mp.main([*args[:4], "--mesh", "fsdp=3"]) == 2
    assert "has 3 positions but there are 8 devices" in capsys.readouterr().err


def test_axis_table_names_every_rule():
    table = mp.axis_table()
    assert "| fsdp | batch, embed |" in table and "| expert | expert |" in table
    assert "| tensor | vocab, heads, kv_heads, mlp |" in table


def test_script_runs_as_a_program():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny_qwen3_moe", "--accelerator", "v5p-8", "--mesh", "fsdp=-1",
         "--rollout-tokens", "32", "--train-seq-len", "32", "--rollout-batch", "4", "--train-batch", "4"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tiny_qwen3_moe on 4 chips" in result.stdout


# ------------------------------------------------------------------------------ Cloud TPU files

TPU_SCRIPTS = sorted((ROOT / "scripts" / "tpu").glob("*.sh"))
POD_CONFIGS = sorted((ROOT / "configs" / "pods").glob("*.yaml"))


def test_tpu_scripts_exist():
    assert {p.name for p in TPU_SCRIPTS} >= {"create.sh", "install.sh", "launch.sh", "logs.sh"}


@pytest.mark.parametrize("script", TPU_SCRIPTS, ids=lambda p: p.name)
def test_tpu_script_is_valid_bash_with_help(script):
    text = script.read_text()
    assert "set -euo pipefail" in text
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    # --help must print usage and exit before touching gcloud.
    shown = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert shown.returncode == 0 and "usage" in shown.stdout.lower(), shown.stdout + shown.stderr


@pytest.mark.parametrize("path", POD_CONFIGS, ids=lambda p: p.name)
def test_pod_config_mesh_fits_its_slice(path):
    raw = yaml.safe_load(path.read_text())
    mesh = raw["mesh"]
    unknown = set(mesh) - set(MeshConfig.__dataclass_fields__)
    assert not unknown, f"{path.name}: unknown mesh keys {unknown}"
    chip, chips = mp.accelerator_chips(path.stem)  # the file is named after its accelerator type
    train_chips = chips - chips // chip.chips_per_host * mesh.get("rollout_devices", 0)  # r per host
    shape = MeshConfig(**mesh).shape()
    assert math.prod(mp.resolve_mesh(shape, train_chips).values()) == train_chips
    if (path.parent / raw["base"]).exists():  # the base run config is written separately
        config = load_config(path)
        assert config.mesh == MeshConfig(**mesh)



# A stand-in for `gcloud` that logs each call, answers `describe` from a queue of TPU states and
# `ssh` commands that start sao-train from a queue of exit codes; everything else succeeds.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
args="$*"
echo "gcloud ${args//$'\n'/ }" >> "$FAKE_DIR/calls"  # one line per call
pop() { local first; first="$(head -n 1 "$1" 2>/dev/null || true)"; sed -i 1d "$1" 2>/dev/null || true; echo "$first"; }
case "$*" in
  *"tpu-vm describe"*) pop "$FAKE_DIR/states" ;;
  *"tpu-vm ssh"*sao-train*) exit "$(pop "$FAKE_DIR/job_codes")" ;;
esac
exit 0
"""


def _run_with_fake_gcloud(tmp_path, script, args, *, states, job_codes=()):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "gcloud"
    fake.write_text(FAKE_GCLOUD)
    fake.chmod(0o755)
    (tmp_path / "states").write_text("".join(f"{s}\n" for s in states))
    (tmp_path / "job_codes").write_text("".join(f"{c}\n" for c in job_codes))
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_DIR": str(tmp_path),
           "POLL_S": "0", "TPU_NAME": "t", "ZONE": "z"}  # fmt: skip
    result = subprocess.run(["bash", str(ROOT / "scripts" / "tpu" / script), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    verbs = [call.split()[4] for call in calls]  # "gcloud compute tpus tpu-vm VERB ..."
    return result, verbs, calls


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        (["READY"], ["describe"]),
        (["", "CREATING", "READY"], ["describe", "create", "describe", "describe"]),
        (["PREEMPTED", "", "READY"], ["describe", "delete", "describe", "create", "describe"]),
    ],
    ids=["reuses_ready", "creates_missing_and_waits", "replaces_preempted"],
)  # fmt: skip
def test_create_is_idempotent(tmp_path, states, expected):
    result, verbs, calls = _run_with_fake_gcloud(tmp_path, "create.sh", [], states=states)
    assert result.returncode == 0, result.stderr
    assert verbs == expected
    creates = [c for c in calls if "tpu-vm create" in c]
    assert all("--accelerator-type=v5p-64" in c and "--version=v2-alpha-tpuv5" in c for c in creates)


def test_launch_recreates_a_preempted_slice_and_resumes(tmp_path):
    # Attempt 1 fails and the slice reads PREEMPTED: create.sh --recreate (delete, create), install.sh
    # (scp + ssh installs), then attempt 2 runs and succeeds. The archive comes from this repository.
    states = ["PREEMPTED", "PREEMPTED", "READY"]  # launch's check, create.sh's first look, after create
    result, verbs, calls = _run_with_fake_gcloud(
        tmp_path, "launch.sh", ["--config", "configs/pods/v5p-64.yaml", "--name", "r", "--", "seed=3"],
        states=states, job_codes=[1, 0],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = [c for c in calls if "sao-train" in c]
    assert len(jobs) == 2 and all("--worker=all" in c for c in jobs)
    assert all("--config configs/pods/v5p-64.yaml --resume output_dir=/mnt/gcs/runs/r seed=3" in c for c in jobs)
    first_job, second_job = [i for i, c in enumerate(calls) if "sao-train" in c]
    # launch reads the state; create.sh --recreate; install.sh --mount: copy, install, mount.
    assert verbs[first_job + 1:second_job] == ["describe", "describe", "delete", "create", "describe", "scp", "ssh", "ssh"]
    assert (tmp_path / "logs" / "tpu" / "r" / "attempt-2.log").exists()


def test_launch_gives_up_after_max_restarts(tmp_path):
    result, _, calls = _run_with_fake_gcloud(tmp_path, "launch.sh", ["--max-restarts", "1"],
                                             states=["READY"] * 4, job_codes=[1, 1, 0])  # fmt: skip
    assert result.returncode == 1 and "giving up after 2 attempts" in result.stderr
    assert sum("sao-train" in c for c in calls) == 2
    assert not any("tpu-vm delete" in c for c in calls)  # a READY slice is not recreated


def test_one_micro_batch_holds_gradients_once():
    p = _tiny(train_batch=4)
    assert p["workload"]["gradient_accumulation"] is False
    acts = p["policy"]["activations"]["total"]
    assert p["policy"]["transient_per_chip"] == 4 * POLICY_CHIP + acts  # f32 gradients, once


def test_experts_touched_by_two_tokens_per_replica():
    # 8 sequences over data·fsdp = 4: 2 tokens per replica per decode step hit 1 − (1 − 2/4)² of the experts.
    assert _tiny(rollout_batch=8)["experts_touched"] == pytest.approx(0.75)


def test_logit_chunk_bounds_the_policy_logits():
    acts = _tiny(logit_chunk=4)["policy"]["activations"]
    assert acts["logits"] == 2 * 1 * 4 * 97 * 4  # b · T_chunk · V · f32, logits and their cotangent


def test_a_second_rollout_mesh_on_shared_chips_holds_a_cast_copy():
    # Rollout mesh data=8 on the train chips: a float32 (compute dtype) copy of the policy, replicated.
    p = _tiny(rollout_mesh_shape={"data": 8})
    assert p["rollout_weights_copy_per_chip"] == 4 * POLICY
    rollout_peak = 4 * POLICY + p["kv_cache"]["per_chip"]
    assert p["chip_peaks"] == {"shared": p["persistent_per_chip"] + max(p["train_transient_per_chip"], rollout_peak)}


def test_shared_chip_peak_is_the_larger_phase_not_the_sum(tiny_plan):
    train = tiny_plan["persistent_per_chip"] + tiny_plan["train_transient_per_chip"]
    assert tiny_plan["rollout_weights_copy_per_chip"] == 0  # read in place on the train mesh
    assert tiny_plan["kv_cache"]["per_chip"] < tiny_plan["train_transient_per_chip"]
    assert tiny_plan["chip_peaks"] == {"shared": train}
