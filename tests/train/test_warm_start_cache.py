"""The warm-start cache (`sft.cache_dir`) for value pretraining: a run that loads a pretrained critic
writes what the run that trained it wrote (which is the uncached run with a store after value
pretraining); the key tells apart the settings value pretraining depends on and no others."""

import json

from sao_jax.config import load_config
from sao_jax.train import warm_start
from sao_jax.train.loop import train

RUN = ["model.preset=tiny_qwen3_moe", "env.train_prompts=16", "env.eval_prompts=2", "env.difficulty=[1]",
       "rollout.num_slots=4", "rollout.max_total_tokens=64", "rollout.max_action_tokens=16", "train.batch_size=4",
       "sft.steps=2", "sft.batch_size=4", "critic.pretrain_rollouts=8", "critic.pretrain_epochs=2",
       "critic.warmup_steps=1", "train.steps=0"]  # fmt: skip
# RUN's value-pretraining key as commit 8a5abc9 computed it, before `env.rl_prompts` existed: critics
# pretrained then are found in the cache now.
OLD_KEY = "631bec4b8367dbcc"


def lines_of(out):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("time/")} for line in lines]


def test_a_cached_pretrained_critic_gives_the_run_that_trained_it(tmp_path, caplog):
    def run(name):
        train(load_config(None, [*RUN, f"output_dir={tmp_path / name}", f"sft.cache_dir={tmp_path / 'cache'}"]))
        return lines_of(tmp_path / name)

    stored = run("stored")
    assert sorted(p.name.split("_")[0] for p in (tmp_path / "cache").iterdir()) == ["critic", "sft"]
    with caplog.at_level("INFO", logger="sao_jax"):
        loaded = run("loaded")
    assert any(r.getMessage().startswith("value pretraining loaded from the cache entry") for r in caplog.records)
    pretraining = [line for line in stored if line.get("stage") == "value_pretrain"]
    assert len(pretraining) == 2 and all(line["value_pretrain/corpus"] == 8 for line in pretraining)
    # Every line is the same: value pretraining's, the critic warmup's (the loaded critic's first
    # updates, on rollouts of the loop that value pretraining ran or skipped) and the evaluation's.
    assert any(line.get("stage") == "critic_warmup" and "critic/value_loss" in line for line in loaded)
    assert loaded == stored


def test_the_value_pretraining_key_follows_what_pretraining_depends_on():
    key = warm_start.value_pretraining_cache_key
    base = load_config(None, RUN)
    # Rows that differ in their policy loss, lag, RL budget or the critic's RL optimizer share one.
    for same in ("loss.name=pg", "rollout.policy_lag=4", "train.steps=9", "critic.optimizer.lr=1e-3",
                 "critic.updates_per_policy_update=4", "critic.warmup_steps=3", "sft.cache_dir=/elsewhere"):
        assert key(load_config(None, [*RUN, same])) == key(base), same
    # The warm start, the corpus, the value head and the batch shape are other critics.
    for other in ("seed=1", "sft.steps=3", "critic.pretrain_rollouts=16", "critic.pretrain_lr=1e-4",
                  "critic.value_head=hl_gauss", "advantage.gamma=0.9", "train.batch_size=8"):
        assert key(load_config(None, [*RUN, other])) != key(base), other
    # RL's share of the pool is the pretraining corpus's, not the warm start's (SFT demonstrates the pool).
    fewer = load_config(None, [*RUN, "env.rl_prompts=8"])
    assert key(fewer) != key(base) and warm_start.sft_cache_key(fewer) == warm_start.sft_cache_key(base)
    # At rl_prompts 0 (the whole pool) the key is the one stored before the setting existed (commit 8a5abc9).
    assert key(base) == OLD_KEY
