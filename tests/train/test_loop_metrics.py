"""Small pieces of the training loop: per-tool shares, the online experiment's per-level quality and
first-action advantage by style, and the weak-demonstrator setting."""

import types

import jax
import numpy as np
import pytest

from sao_jax.config import load_config
from sao_jax.envs.calculator import CalculatorEnv, PythonToolEnv
from sao_jax.envs.guessing import GuessingEnv
from sao_jax.metrics import MetricsWriter, read_metrics
from sao_jax.rollout.failures import DeadEnvironmentError
from sao_jax.train import batches, build, evaluation, loop, warm_start


def _trajectory(env_info):
    return types.SimpleNamespace(info={"env_info": env_info})


def test_tool_share_counts_answered_trajectories_that_called_each_tool():
    trajectories = [_trajectory({"tools": ("calc",)}), _trajectory({"tools": ("est",)}),
                    _trajectory({"tools": ("est", "calc")}), _trajectory({"tools": ()}),
                    _trajectory({"error": "format"})]  # fmt: skip  (the last never answered: not counted)
    assert evaluation.tool_metrics(trajectories, "eval", CalculatorEnv) == {"eval/tool_share/calc": 0.5,
                                                                     "eval/tool_share/est": 0.5}  # fmt: skip
    assert evaluation.tool_metrics([_trajectory({"tools": ("calc",)})], "train", PythonToolEnv) == {
        "train/tool_share/py": 0.0, "train/tool_share/est": 0.0}  # every tool is reported, zeros too
    assert evaluation.tool_metrics(trajectories, "train", GuessingEnv) == {}  # an environment without tools


def test_repair_shares_count_failed_tests_and_repairs_over_every_trajectory():
    from sao_jax.envs.repair import RepairEnv
    trajectories = [_trajectory({"failed_test": False, "repaired": False}),  # right first time
                    _trajectory({"failed_test": True, "repaired": True}),
                    _trajectory({"failed_test": True, "repaired": False}),
                    _trajectory({})]  # fmt: skip  (an env failure: counted, as neither)
    assert evaluation.repair_metrics(trajectories, "eval", RepairEnv) == {"eval/failed_test_share": 0.5,
                                                                         "eval/repaired_share": 0.25}  # fmt: skip
    assert evaluation.repair_metrics(trajectories, "train", CalculatorEnv) == {}  # one answer an episode


def test_success_per_difficulty_level_by_hand():
    prompts = [types.SimpleNamespace(id=i, difficulty=d) for i, d in enumerate([1, 1, 2, 4])]
    reward = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.5}  # 0.5 is not a success
    trajectories = [types.SimpleNamespace(prompt_id=i, outcome_reward=reward[i]) for i in (3, 2, 1, 0)]
    assert evaluation.difficulty_metrics(trajectories, prompts, "eval") == {
        "eval/success_rate/level_1": 0.5, "eval/success_rate/level_2": 1.0, "eval/success_rate/level_4": 0.0}
    one_level = [types.SimpleNamespace(id=0, difficulty=3)]
    assert evaluation.difficulty_metrics(trajectories[3:], one_level, "eval") == {}  # nothing beyond the overall rate


def test_quality_rate_overall_and_per_level_by_hand():
    prompts = [types.SimpleNamespace(id=i, difficulty=d) for i, d in enumerate([1, 1, 4, 4, 4])]
    quality = {0: 1, 1: 1, 2: 0, 3: 1, 4: 0}
    trajectories = [types.SimpleNamespace(prompt_id=i, info={"env_info": {"quality": quality[i]}}) for i in range(5)]
    assert evaluation.quality_metrics(trajectories, prompts, "eval") == {
        "eval/quality_rate": 0.6, "eval/quality_rate/level_1": 1.0, "eval/quality_rate/level_4": 1 / 3}
    assert evaluation.quality_metrics(trajectories[:2], prompts, "train") == {"train/quality_rate": 1.0}  # one level
    unjudged = [types.SimpleNamespace(prompt_id=0, info={"env_info": {"tools": ()}})]
    assert evaluation.quality_metrics(unjudged, prompts, "eval") == {}  # a task without a quality check


def test_first_action_advantage_by_style_averages_each_styles_rows_and_ignores_padding():
    styles = ["cute", "classical", "cute", None]
    trajectories = [_trajectory({"style": s}) for s in styles]
    per_row = np.array([0.5, -1.0, 0.25, 2.0, 99.0, 99.0])  # two padding rows after the four real ones
    schedule = types.SimpleNamespace(current_style="cute")
    assert evaluation.style_advantage_metrics(trajectories, per_row, schedule) == {
        "train/first_action_advantage/cute": 0.375, "train/first_action_advantage/chuunibyou": None,
        "train/first_action_advantage/classical": -1.0, "train/first_action_advantage/none": 2.0}
    assert evaluation.style_advantage_metrics(trajectories, per_row, None) == {}  # not the online task
    assert evaluation.style_advantage_metrics(trajectories, None, schedule) == {}  # no policy update this step


def test_per_row_metrics_leave_the_line_under_their_model():
    scalars, rows = loop.split_row_metrics({"policy/loss": 1.0, "policy/rows/first_action_advantage": [1, 2],
                                            "critic/value_loss": 2.0})  # fmt: skip
    assert scalars == {"policy/loss": 1.0, "critic/value_loss": 2.0}
    assert rows == {"policy/first_action_advantage": [1, 2]}


def test_calculator_episodes_report_the_tools_they_called():
    prompt = CalculatorEnv.generate_prompts(np.random.default_rng(0), 1)[0]
    env = CalculatorEnv()
    env.reset(prompt)
    env.step("<est>1+1</est>\n")
    env.step(f"<calc>{prompt.metadata['expression']}</calc>\n")
    assert env.step(f"A: {prompt.answer}\n").info["tools"] == ("est", "calc")
    env.reset(prompt)  # a new episode starts with none
    assert env.step(f"A: {prompt.answer}\n").info["tools"] == ()


def test_async_metrics_sum_over_processes_and_average_staleness_over_trajectories():
    def engine(idle, histogram, stale, discarded):
        return {"queue_depth": 2, "trainer_idle_fraction": idle, "trajectories_per_s": 8.0,
                "action_tokens_per_s": 80.0, "staleness_histogram": histogram, "trajectories_dropped_stale": stale,
                "trajectories_discarded": discarded, "trajectories_failed": 1}  # fmt: skip

    metrics = batches.async_metrics([engine(0.25, {0: 3, 2: 1}, 4, 1), engine(0.75, {1: 2, 2: 1}, 0, 2)])
    assert metrics == {
        "async/queue_depth": 4, "async/trainer_idle_fraction": 0.5, "async/trajectories_per_s": 16.0,
        "async/action_tokens_per_s": 160.0, "async/dropped_stale": 4,
        "async/staleness_mean": 6 / 7,  # (0·3 + 1·2 + 2·2) / 7 trajectories, not a mean over the 3 keys
        "train/env_failed": 2, "train/group_members_discarded": 3,
    }  # fmt: skip


def test_weak_demonstrations_need_an_environment_that_has_them(tmp_path):
    config = load_config(overrides=["env.name=guessing", "sft.weak_demonstration_fraction=0.5", "sft.steps=1",
                                    f"output_dir={tmp_path}"])  # fmt: skip
    run = build.build_run(config)
    with pytest.raises(ValueError, match="sft.weak_demonstration_fraction: environment 'guessing' has no weak"):
        warm_start.run_sft(run, writer=None)


def _sft_lines(path):
    return [line for line in read_metrics(path / "metrics.jsonl") if line.get("stage") == "sft"]


def test_sft_cache_returns_the_same_warm_start_and_metric_lines(tmp_path):
    def sft(name, *extra):
        config = load_config(overrides=["sft.steps=3", "sft.batch_size=4", "env.train_prompts=16",
                                        f"output_dir={tmp_path / name}", *extra])  # fmt: skip
        with MetricsWriter(tmp_path / name, tensorboard=False) as writer:
            params = warm_start.run_sft(build.build_run(config), writer)
        return jax.tree.map(np.asarray, params), config

    plain, _ = sft("plain")
    stored, config = sft("stored", f"sft.cache_dir={tmp_path / 'cache'}")
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.name == f"sft_{warm_start.sft_cache_key(config)}.npz"
    loaded, _ = sft("loaded", f"sft.cache_dir={tmp_path / 'cache'}")
    for a, b, c in zip(jax.tree.leaves(plain), jax.tree.leaves(stored), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert _sft_lines(tmp_path / "loaded") == _sft_lines(tmp_path / "plain") != []
    # Another seed or other SFT settings are other warm starts; where the cache lives is not a setting.
    other = load_config(overrides=["seed=1", f"sft.cache_dir={tmp_path}"])
    assert warm_start.sft_cache_key(other) != warm_start.sft_cache_key(load_config(overrides=[f"sft.cache_dir={tmp_path}"]))
    assert warm_start.sft_cache_key(load_config(overrides=["sft.cache_dir=/a"])) == warm_start.sft_cache_key(load_config())


def test_run_summary_reports_the_warm_start_and_whether_the_gain_beats_its_noise():
    lines = [{"stage": "sft", "sft/step": 24, "sft/demonstration_probability": 0.41},
             {"stage": "sft", "sft/step": 49, "sft/demonstration_probability": 0.83, "sft/stopped_at_target": 1},
             {"step": 0, "eval/success_rate": 0.25}, {"step": 5, "train/reward_mean": 0.5},
             {"step": 10, "eval/success_rate": 0.5}]  # fmt: skip
    summary = evaluation.run_summary(lines, num_eval_prompts=64, steps=10)
    assert summary["warm_start"] == {"sft_steps": 50, "demonstration_probability": 0.83, "reached_target": True}
    assert (summary["eval_success_start"], summary["eval_success_end"]) == (0.25, 0.5)
    # standard error of the gain: sqrt((0.25·0.75 + 0.5·0.5) / 64) = sqrt(0.4375 / 64) = 0.0826797
    assert summary["gain"] == 0.25 and summary["gain_standard_error"] == pytest.approx(0.0826797, abs=1e-6)
    assert summary["learned"] is True  # 0.25 > 2 · 0.0827
    assert evaluation.summary_line(summary) == "held-out success 25.0% -> 50.0% (+25.0 points in 10 RL steps): learned"
    small = evaluation.run_summary([*lines[:3], {"step": 10, "eval/success_rate": 0.375}], num_eval_prompts=64, steps=10)
    assert small["learned"] is False  # 0.125 < 2 · sqrt((0.1875 + 0.234375) / 64) = 0.1624
    assert "did not learn" in evaluation.summary_line(small)
    assert evaluation.run_summary(lines[:3], num_eval_prompts=64, steps=0).get("learned") is None
    assert "skipped_prompts" not in summary  # only a run that left prompts out says so
    skipping = evaluation.run_summary(lines, num_eval_prompts=64, steps=10, skipped_prompts={"env.train_file": 4})
    assert skipping == summary | {"skipped_prompts": {"env.train_file": 4}}


def test_run_summary_never_reports_an_evaluation_that_did_not_run():
    """Every RL step lost its rollouts (skipped, no evaluation after step 0): the end is None, not the
    start again, and no step counts as trained."""
    lines = [{"step": 0, "eval/success_rate": 0.25}, *({"step": s, "train/skipped_no_data": 1} for s in (1, 2, 3))]
    summary = evaluation.run_summary(lines, num_eval_prompts=8)
    assert (summary["eval_success_start"], summary["eval_success_end"], summary["steps"]) == (0.25, None, 0)
    assert "gain" not in summary
    assert evaluation.summary_line(summary) == "held-out success: not evaluated twice (no verdict)"
    trained = [*lines, {"step": 4, "train/reward_mean": 0.5}, {"step": 5, "eval/success_rate": 0.5}]
    assert evaluation.run_summary(trained, num_eval_prompts=8)["steps"] == 2  # steps 4 and 5 trained


@pytest.mark.parametrize("damage", ["truncated", "other_shapes"])
def test_an_unreadable_sft_cache_entry_is_named_moved_aside_and_redone(tmp_path, caplog, damage):
    def sft(name):
        config = load_config(overrides=["model.preset=tiny_qwen3_moe", "sft.steps=2", "sft.batch_size=4",
                                        "sft.target_demonstration_probability=0", "env.train_prompts=16",
                                        "env.difficulty=[1]", "rollout.max_total_tokens=64",
                                        f"sft.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / name}"])  # fmt: skip
        with MetricsWriter(tmp_path / name, tensorboard=False) as writer:
            params = warm_start.run_sft(build.build_run(config), writer)
        return jax.tree.map(np.asarray, params), config

    stored, config = sft("stored")
    entry = tmp_path / "cache" / f"sft_{warm_start.sft_cache_key(config)}.npz"
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a copy cut short
    else:
        leaves = {f"leaf_{i}": np.zeros(3) for i in range(len(jax.tree.leaves(stored)))}
        np.savez(entry, metrics="[]", **leaves)
    damaged = entry.read_bytes()
    with caplog.at_level("WARNING", logger="sao_jax"):
        redone, _ = sft("redone")
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith(f"the SFT cache entry {entry} is unreadable (")
    assert said[0].endswith(f"moved it aside to {entry.with_suffix('.unreadable.npz')} and training it again")
    assert entry.with_suffix(".unreadable.npz").read_bytes() == damaged  # kept for whoever wants to look
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(redone)):  # redone: the same warm start
        np.testing.assert_array_equal(a, b)
    assert _sft_lines(tmp_path / "redone") == _sft_lines(tmp_path / "stored") != []
    loaded, _ = sft("loaded")  # and stored again, whole
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)


def test_value_pretraining_needs_its_floor_of_usable_rollouts():
    """At most half of critic.pretrain_rollouts (by default) may fail, and one batch must be left:
    below that the run stops naming the most frequent error, instead of an IndexError."""
    config = load_config(overrides=["critic.pretrain_rollouts=8", "train.batch_size=4"])
    failed = [_trajectory({}) for _ in range(5)]
    for i, t in enumerate(failed):
        t.info["error"] = "env.step raised RuntimeError: gone" if i else "env.reset did not return within its deadline"
    with pytest.raises(DeadEnvironmentError, match=r"^value pretraining got 3 usable rollouts of 8, fewer than its "
                                                   r"floor of 4 .* the environment failed 5, most often "
                                                   r"'env.step raised RuntimeError: gone' \(4 times\)$"):  # fmt: skip
        warm_start.check_pretraining_corpus(config, failed + [_trajectory({}) for _ in range(3)], 3)
    warm_start.check_pretraining_corpus(config, failed[:4] + [_trajectory({}) for _ in range(4)], 4)
    lenient = load_config(overrides=["critic.pretrain_rollouts=8", "train.batch_size=4",
                                     "critic.pretrain_min_usable_fraction=0"])  # fmt: skip
    with pytest.raises(DeadEnvironmentError, match="fewer than its floor of 4"):  # one batch, whatever the share
        warm_start.check_pretraining_corpus(lenient, failed + [_trajectory({}) for _ in range(3)], 3)
