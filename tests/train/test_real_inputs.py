"""The real-model path of the trainer: a Hugging Face folder (weights, tokenizer, chat template) and
prompt files, through `configs/tir/tiny_tir.yaml`.

The folder holds a tiny Qwen3-MoE written by `save_pretrained` and a byte-level BPE with a ChatML
template built here (`tests/data/test_chat.py`); `transformers`' `apply_chat_template` on the same
files is the independent reference for the tokens an episode starts with.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import PreTrainedTokenizerFast

from sao_jax import models
from sao_jax.config import ConfigError, load_config
from sao_jax.data.chat import ChatEnv, HFTokenizer
from sao_jax.envs.tir import TIREnv
from sao_jax.train.build import build_run
from sao_jax.train.loop import train
from tests.data.test_chat import CHATML, FORMATS, write_folder

ROOT = Path(__file__).resolve().parents[2]
TINY_TIR = ROOT / "configs" / "tir" / "tiny_tir.yaml"
TRAIN = [("What is 2/3 + 1/6? Give it as a fraction in lowest terms.", "\\frac{5}{6}"),
         ("What is the remainder when 17*23 + 5 is divided by 7?", "3"),
         ("In how many ways can a committee of 2 be chosen from 5 people?", "10"),
         ("What is 1/2 + 1/3?", "\\frac{5}{6}")]  # fmt: skip
EVAL = [("What is 3^4 mod 5?", "1"), ("In how many ways can 3 people stand in a row?", "6")]


def write_prompts(path: Path, pairs) -> Path:
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in pairs))
    return path


def write_model(folder: Path, vocab_size: int) -> Path:
    """A Hugging Face folder: a tiny Qwen3-MoE and the ChatML tokenizer."""
    write_folder(folder, CHATML, FORMATS["chatml"][1])
    models.save_pretrained(models.Policy(models.tiny_qwen3_moe(vocab_size=vocab_size), rngs=nnx.Rngs(0)), folder)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    vocab = HFTokenizer.from_folder(write_folder(tmp / "tokenizer", CHATML, FORMATS["chatml"][1])).vocab_size
    return write_model(tmp / "model", vocab_size=vocab + 3)


@pytest.fixture(scope="module")
def inputs(model_folder, tmp_path_factory):
    """Overrides naming the model folder and the prompt files."""
    tmp = tmp_path_factory.mktemp("prompts")
    return [f"model.pretrained={model_folder}", f"env.train_file={write_prompts(tmp / 'train.jsonl', TRAIN)}",
            f"env.eval_file={write_prompts(tmp / 'eval.jsonl', EVAL)}", "rollout.max_total_tokens=96"]  # fmt: skip


def test_pretrained_folder_brings_tokenizer_chat_format_dtypes_and_file_prompts(model_folder, inputs, tmp_path):
    run = build_run(load_config(TINY_TIR, [*inputs, f"output_dir={tmp_path}"]))
    assert isinstance(run.tokenizer, HFTokenizer)
    assert [(p.id, p.text, p.answer) for p in run.train_prompts] == [(i, q, a) for i, (q, a) in enumerate(TRAIN)]
    assert [p.text for p in run.eval_prompts] == [q for q, _ in EVAL]
    # The recipe's dtypes (qwen3_30b_a3b.yaml): bfloat16 compute, float32 storage.
    assert run.policy.config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(run.policy, nnx.Param))} == {jnp.dtype("float32")}
    env = run.env_factory(run.train_prompts[0])
    assert isinstance(env, ChatEnv) and isinstance(env.env, TIREnv)

    # An episode starts with the template's rendering of the user turn and nothing before it (no BOS).
    [trajectory] = run.agent_loop(greedy=True).rollout((nnx.state(run.policy), 0), run.train_prompts[:1],
                                                      jax.random.key(0))  # fmt: skip
    reference = PreTrainedTokenizerFast.from_pretrained(model_folder)
    expected = reference.apply_chat_template([{"role": "user", "content": TRAIN[0][0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)  # fmt: skip  (5.x's default: a dict)
    assert trajectory.info["error"] is None
    assert trajectory.tokens[: len(expected)].tolist() == expected
    assert not trajectory.action_mask[: len(expected)].any() and trajectory.action_mask[len(expected)]


@pytest.mark.slow
def test_two_step_run_on_the_pretrained_folder_and_prompt_files(inputs, tmp_path):
    summary = train(load_config(TINY_TIR, [*inputs, f"output_dir={tmp_path}"]))
    lines = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The critic's warmup step (critic.warmup_steps: 1) comes before RL: two policy updates, steps 1 and 2.
    assert [(line["step"], line.get("stage")) for line in lines] == [(0, "critic_warmup"), (0, None), (1, None),
                                                                      (2, None)]  # fmt: skip
    assert lines[0]["critic_warmup/failed_rollouts"] == 0 and np.isfinite(lines[0]["critic/value_loss"])
    assert all(line["train/env_failed"] == 0 and line["train/action_tokens"] > 0 for line in lines[2:])
    assert all(np.isfinite(line["policy/loss"]) for line in lines[2:]) and lines[3]["eval/env_errors"] == 0
    assert summary["steps"] == 2 and (tmp_path / "checkpoints" / "2").is_dir()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_an_error(tmp_path):
    folder = write_model(tmp_path / "model", vocab_size=97)
    with pytest.raises(ValueError, match="more than the model's vocab_size 97"):
        build_run(load_config(TINY_TIR, [f"model.pretrained={folder}", f"output_dir={tmp_path}"]))


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the kernel compiles on a TPU")
def test_the_gmm_dispatch_off_a_tpu_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.moe_dispatch=gmm .* only on a TPU .*backend is"):
        build_run(load_config(TINY_TIR, ["model.moe_dispatch=gmm", f"output_dir={tmp_path}"]))


def test_model_dtype_must_be_a_known_dtype():
    with pytest.raises(ConfigError, match="model.dtype must be one of float32, bfloat16, float16"):
        load_config(TINY_TIR, ["model.dtype=bf16"])


@pytest.mark.parametrize("path", ["tir/qwen3_30b_a3b.yaml", "pods/v5p-64.yaml", "pods/v5p-256.yaml"])
def test_the_30b_recipe_holds_the_papers_math_with_python_settings(path):
    config = load_config(ROOT / "configs" / path)
    assert config.env.name == "tir" and config.model.pretrained and config.sft.steps == 0
    assert (config.model.dtype, config.model.param_dtype) == ("bfloat16", "float32")
    assert (config.train.batch_size, config.advantage.group_size, config.train.mode) == (128, 1, "sync")
    assert (config.policy.optimizer.lr, config.critic.optimizer.lr) == (1e-6, 5e-6)
    assert (config.critic.updates_per_policy_update, config.critic.warmup_steps) == (2, 10)
    assert (config.advantage.estimator, config.advantage.lam_critic, config.advantage.length_adaptive_alpha,
            config.advantage.gamma) == ("skip_observation_gae", 1.0, 1.5, 1.0)  # fmt: skip
    assert (config.loss.name, config.loss.eps_low, config.loss.eps_high) == ("dis", 0.3, 5.0)
    assert config.mesh.fsdp == -1 and config.mesh.rollout_devices == 0
