"""configs/ (every file loads; each ablation is its base plus exactly what it names) and
scripts/reproduce.py (statistics against hand computations, the report from synthetic metrics files,
resumable runs with a stubbed `train`, and one real tiny run)."""

import importlib.util
import json
import math
import pathlib
import signal
import sys
import time

import pytest
import yaml

from sao_jax.config import ConfigError, load_config, to_dict
from sao_jax.envs.judges import STYLES
from sao_jax.train.signals import Interrupted

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ABLATIONS = CONFIGS / "ablations"


def _load_script():
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


reproduce = _load_script()


def _config_params(paths):
    return [pytest.param(p, id=str(p.relative_to(CONFIGS))) for p in paths]


def flatten(tree, prefix=""):
    """{"a.b": leaf} of a nested dict (lists are leaves)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def plain(config):
    return json.loads(json.dumps(to_dict(config)))


# ------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("path", _config_params(sorted(CONFIGS.rglob("*.yaml"))))
def test_every_config_file_loads(path):
    if path.parent.name == "scaffold":  # the model folder comes from the command line (README, "Agent scaffolds")
        with pytest.raises(ConfigError, match="^model.pretrained must name a Hugging Face folder"):
            load_config(path)
        return
    load_config(path)


def test_default_yaml_is_the_embedded_default():
    assert to_dict(load_config(CONFIGS / "default.yaml")) == to_dict(load_config(None))


@pytest.mark.parametrize("path", _config_params(sorted(ABLATIONS.rglob("*.yaml"))))
def test_ablation_differs_from_its_base_only_in_the_keys_it_names(path):
    raw = yaml.safe_load(path.read_text())
    base = path.parent / raw.pop("base")
    named = set(flatten(raw))
    got, expected = flatten(plain(load_config(path))), flatten(plain(load_config(base)))
    changed = {k for k in got if got[k] != expected.get(k)}  # env.options keys exist only where named
    assert changed <= named, f"{path.name} changes {sorted(changed - named)} without naming them"
    for key in named:  # each named key holds the value the file gives it
        assert got[key] == raw_value(raw, key), key


def raw_value(raw, dotted):
    for key in dotted.split("."):
        raw = raw[key]
    return json.loads(json.dumps(raw))


# The settings that define each ablation row (dotted key -> value), checked on the loaded configs.
ROW_SETTINGS = {
    "table4/no_faster_value": {"critic.updates_per_policy_update": 1},
    "table4/no_frozen_attention": {"critic.trainable_patterns": [".*"]},
    "table4/vanilla_vapo": {"loss.name": "ppo_clip", "loss.eps_low": 0.2, "loss.eps_high": 0.28},
    "table4/running_mean": {"advantage.estimator": "running_mean", "advantage.running_mean_scope": "per_prompt",
                            "advantage.running_mean_window": 8},
    "table4/grpo_dis": {"advantage.estimator": "grpo", "advantage.group_size": 8, "loss.name": "dis"},
    "table5/step_average": {"advantage.estimator": "step_gae_mean"},
    "table5/step_last_token": {"advantage.estimator": "step_gae_last"},
    "table5/token_level": {"advantage.estimator": "skip_observation_gae"},
    "open/skip_observation": {"env.name": "guessing", "advantage.estimator": "skip_observation_gae"},
    "open/cross_observation": {"env.name": "guessing", "advantage.estimator": "cross_observation_gae"},
    "open/dis": {"loss.name": "dis"},
    "open/estr": {"loss.name": "estr"},
    "online/sao": {"env.name": "style_shift", "advantage.estimator": "skip_observation_gae"},
    "online/running_mean": {"env.name": "style_shift", "advantage.estimator": "running_mean",
                            "advantage.running_mean_scope": "global", "advantage.running_mean_window": 128},
    "online_hetero/sao": {"env.name": "topic_style_shift", "env.difficulty": [1, 2, 3, 4],
                          "advantage.estimator": "skip_observation_gae", "loss.kl_coef": 0.3},
    "online_hetero/running_mean_batch": {"env.name": "topic_style_shift", "advantage.estimator": "running_mean",
                                         "advantage.running_mean_scope": "global", "advantage.running_mean_window": 32,
                                         "train.batch_size": 32, "critic.pretrain_rollouts": 0},
    "online_hetero/running_mean_128": {"env.name": "topic_style_shift", "advantage.estimator": "running_mean",
                                       "advantage.running_mean_scope": "global", "advantage.running_mean_window": 128,
                                       "critic.pretrain_rollouts": 0},
    "repair/skip_observation": {"env.name": "repair", "advantage.estimator": "skip_observation_gae"},
    "repair/cross_observation": {"env.name": "repair", "advantage.estimator": "cross_observation_gae"},
    "repair/frozen_unseen": {"env.name": "repair", "env.options.demonstrate_repair": False},
    "repair/trained_unseen": {"env.name": "repair", "env.options.demonstrate_repair": False,
                              "critic.trainable_patterns": [".*"]},
    "repair/skip_trained_attention": {"env.name": "repair", "advantage.estimator": "skip_observation_gae",
                                      "critic.trainable_patterns": [".*"]},
    "repair/cross_trained_attention": {"env.name": "repair", "advantage.estimator": "cross_observation_gae",
                                       "critic.trainable_patterns": [".*"]},
    "critic/sao_pool": {"env.name": "chain", "env.train_prompts": 4096, "env.rl_prompts": 200,
                        "advantage.estimator": "skip_observation_gae"},
    "critic/running_mean_pool": {"env.train_prompts": 4096, "env.rl_prompts": 200, "advantage.estimator": "running_mean",
                                 "advantage.running_mean_scope": "per_prompt", "advantage.running_mean_window": 8,
                                 "critic.pretrain_rollouts": 0, "critic.warmup_steps": 0},
    "critic/running_mean": {"env.train_prompts": 4096, "advantage.estimator": "running_mean",
                            "advantage.running_mean_scope": "per_prompt", "advantage.running_mean_window": 8},
    "critic/grpo_dis": {"advantage.estimator": "grpo", "advantage.group_size": 8, "loss.name": "dis"},
    "critic/sao_pretrain0": {"critic.pretrain_rollouts": 0},
    "critic/sao_pretrain256": {"critic.pretrain_rollouts": 256},
    "critic/sao_pretrain1024": {"critic.pretrain_rollouts": 1024},
    "offpolicy/dis": {"env.name": "chain", "loss.name": "dis", "train.mode": "sync",
                      "rollout.policy_lag_spread": "fixed"},
    "offpolicy/pg": {"loss.name": "pg"},
    "offpolicy/ppo_clip": {"loss.name": "ppo_clip_rollout", "loss.eps_low": 0.2, "loss.eps_high": 0.28},
    "offpolicy/icepop": {"loss.name": "icepop", "loss.icepop_alpha": 0.5, "loss.icepop_beta": 5.0},
    "offpolicy/estr": {"loss.name": "estr"},
    "offpolicy/dis_no_lag": {"loss.name": "dis", "rollout.policy_lag": 0},
}  # fmt: skip


@pytest.mark.parametrize("row", _config_params([ABLATIONS / f"{r}.yaml" for r in ROW_SETTINGS]))
def test_rows_hold_the_settings_that_define_them(row):
    got = flatten(plain(load_config(row)))
    for key, value in ROW_SETTINGS[f"{row.parent.name}/{row.stem}"].items():
        assert got[key] == value, key


def test_sao_rows_are_the_default_and_paired_rows_share_everything_but_their_variable():
    default = plain(load_config(CONFIGS / "default.yaml"))
    assert plain(load_config(ABLATIONS / "table4" / "sao.yaml")) == default
    assert plain(load_config(ABLATIONS / "table5" / "token_level.yaml")) == default
    skip = flatten(plain(load_config(ABLATIONS / "open" / "skip_observation.yaml")))
    cross = flatten(plain(load_config(ABLATIONS / "open" / "cross_observation.yaml")))
    assert {k for k in skip if skip[k] != cross[k]} == {"advantage.estimator"}
    dis = flatten(plain(load_config(ABLATIONS / "open" / "dis.yaml")))
    estr = flatten(plain(load_config(ABLATIONS / "open" / "estr.yaml")))
    assert {k for k in dis if dis[k] != estr[k]} == {"loss.name"}  # estr_tau 1.0 is the default too
    assert dis["train.mode"] == "async"
    pairs = {("skip_observation", "cross_observation"): {"advantage.estimator"},
             ("frozen_unseen", "trained_unseen"): {"critic.trainable_patterns"},
             ("skip_observation", "frozen_unseen"): {"env.options.demonstrate_repair"},
             ("skip_trained_attention", "cross_trained_attention"): {"advantage.estimator"},
             ("skip_observation", "skip_trained_attention"): {"critic.trainable_patterns"}}  # fmt: skip
    for (a, b), differ in pairs.items():
        a, b = (flatten(plain(load_config(ABLATIONS / "repair" / f"{name}.yaml"))) for name in (a, b))
        assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == differ
    # The off-policy suite: DIS at L = 0 is the critic suite's SAO row but for its advantage-quality
    # probe; every row shares the DIS row's lag L > 0 and its settings but for the policy loss (the
    # PPO-clip row also its clip range).
    critic_sao = flatten(plain(load_config(ABLATIONS / "critic" / "sao.yaml")))
    no_lag = flatten(plain(load_config(ABLATIONS / "offpolicy" / "dis_no_lag.yaml")))
    assert {k for k in critic_sao if critic_sao[k] != no_lag[k]} == {"train.probe_every"}
    assert no_lag["train.probe_every"] == 0 and no_lag["rollout.policy_lag"] == 0
    dis = flatten(plain(load_config(ABLATIONS / "offpolicy" / "dis.yaml")))
    assert dis["rollout.policy_lag"] > 0
    for name, differ in {"pg": {"loss.name"}, "icepop": {"loss.name"}, "estr": {"loss.name"},
                         "ppo_clip": {"loss.name", "loss.eps_low", "loss.eps_high"}}.items():  # fmt: skip
        row = flatten(plain(load_config(ABLATIONS / "offpolicy" / f"{name}.yaml")))
        assert {k for k in row if row[k] != dis[k]} == differ, name


def test_critic_suite_rows_differ_only_in_their_variable_and_share_trajectories():
    def row(name):
        return flatten(plain(load_config(ABLATIONS / "critic" / f"{name}.yaml")))

    def differ(a, b):
        return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}

    sao, sao_pool = row("sao"), row("sao_pool")
    assert differ(sao, sao_pool) == {"env.rl_prompts"}  # RL's prompts only: SFT's pool is the same
    assert differ(row("running_mean"), row("running_mean_pool")) == {"env.rl_prompts"}
    for n in (0, 256, 1024):
        assert differ(sao, row(f"sao_pretrain{n}")) == {"critic.pretrain_rollouts"}
    # The pool recurs: ≥ 16 draws of each prompt on average over the run; the large pool does not.
    assert sao["train.steps"] * sao["train.batch_size"] / sao_pool["env.rl_prompts"] >= 16
    assert sao["train.steps"] * sao["train.batch_size"] / sao["env.train_prompts"] < 1
    # Both pools' rows start from one warm start (SFT on the whole pool) but pretrain the critic on their own.
    from sao_jax.train.warm_start import sft_cache_key, value_pretraining_cache_key

    big, small = (load_config(ABLATIONS / "critic" / f"{name}.yaml") for name in ("sao", "sao_pool"))
    assert sft_cache_key(big) == sft_cache_key(small)
    assert value_pretraining_cache_key(big) != value_pretraining_cache_key(small)
    # Equal budgets: every row makes the same policy updates on the same number of trajectories a step.
    for name in ("running_mean", "grpo_dis", "running_mean_pool"):
        assert (row(name)["train.steps"], row(name)["train.batch_size"]) == (sao["train.steps"], sao["train.batch_size"])


def test_interaction_is_the_paired_difference_of_differences(tmp_path):
    # Final success per seed: a − b − (c − d) = (0.9 − 0.5) − (0.6 − 0.6) = 0.4 and (0.8 − 0.6) − (0.7 − 0.6) = 0.1.
    finals = {"sao_pool": [0.9, 0.8], "running_mean_pool": [0.5, 0.6], "sao": [0.6, 0.7], "running_mean": [0.6, 0.6]}
    for row, values in finals.items():
        for seed, final in enumerate(values):
            folder = reproduce.run_dir(tmp_path, "critic", row, seed)
            folder.mkdir(parents=True)
            (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, reproduce.SUCCESS_KEY: 0.2}) + "\n" +
                                                  json.dumps({"step": 200, reproduce.SUCCESS_KEY: final}) + "\n")
            (folder / "summary.json").write_text("{}")
    [line] = [line for line in reproduce.interaction_table("critic", reproduce.SUITES["critic"], tmp_path)
              if line.startswith("| (SAO")]  # fmt: skip
    mean, half = reproduce.mean_ci95([0.4, 0.1])
    assert f"| 2 | {100 * mean:+.1f} ± {100 * half:.1f} | no / no |" in line


@pytest.mark.parametrize("suite", ["online", "online_hetero"])
def test_online_schedule_switches_at_least_twice_within_the_run(suite):
    config = load_config(ABLATIONS / suite / "sao.yaml")
    switches = config.env.options["switches"]
    assert len(switches) >= 3 and switches[0][0] == 0
    assert all(step < config.train.steps for step, _ in switches)


def test_online_hetero_rows_differ_only_in_the_baseline():
    rows = {name: flatten(plain(load_config(ABLATIONS / "online_hetero" / f"{name}.yaml")))
            for name in ("sao", "running_mean_batch", "running_mean_128")}  # fmt: skip
    differ = lambda a, b: {k for k in rows[a].keys() | rows[b].keys() if rows[a].get(k) != rows[b].get(k)}
    assert differ("running_mean_batch", "running_mean_128") == {"advantage.running_mean_window"}
    assert differ("sao", "running_mean_batch") == {"advantage.estimator", "advantage.running_mean_scope",
                                                   "advantage.running_mean_window", "critic.pretrain_rollouts",
                                                   "critic.warmup_steps"}  # fmt: skip
    # The paper's window is one batch: it must follow the batch size.
    assert rows["running_mean_batch"]["advantage.running_mean_window"] == rows["sao"]["train.batch_size"]
    # The one-topic online rows' policy settings (the KL floor, the batch, the learning rate) carry over;
    # the phases are longer (90 steps), the rewarded style cycling through every archetype.
    online = flatten(plain(load_config(ABLATIONS / "online" / "sao.yaml")))
    for key in ("loss.kl_coef", "train.batch_size", "policy.optimizer.lr", "rollout.max_action_tokens"):
        assert rows["sao"][key] == online[key], key
    switches = rows["sao"]["env.options.switches"]
    assert [step for step, _ in switches] == list(range(0, rows["sao"]["train.steps"], 90))
    assert {style for _, style in switches} == set(STYLES)
    assert reproduce.STYLE_NAMES == STYLES


def test_every_suite_row_has_a_config_and_every_ablation_config_is_a_row():
    rows = {f"{name}/{row.name}" for name, suite in reproduce.SUITES.items() for row in suite.rows}
    files = {f"{p.parent.name}/{p.stem}" for p in ABLATIONS.rglob("*.yaml")}
    assert rows == files


# ----------------------------------------------------------------------------------- statistics


def test_mean_ci95_matches_hand_computation():
    # [0.5, 0.7, 0.9]: mean 0.7, s = 0.2, t_{0.975, 2} = 4.303 -> 4.303 · 0.2 / √3 = 0.4968679
    mean, half = reproduce.mean_ci95([0.5, 0.7, 0.9])
    assert mean == pytest.approx(0.7) and half == pytest.approx(0.4968679, abs=1e-6)
    # [1, 2, 3, 4, 5]: s = √2.5, t_{0.975, 4} = 2.776 -> 2.776 · 1.5811388 / √5 = 1.9629280
    mean, half = reproduce.mean_ci95([1, 2, 3, 4, 5])
    assert mean == pytest.approx(3.0) and half == pytest.approx(1.9629280, abs=1e-6)
    mean, half = reproduce.mean_ci95([0.25])
    assert mean == 0.25 and math.isnan(half)


def test_t_table_matches_scipy_and_rounds_down_to_a_wider_interval():
    stats = pytest.importorskip("scipy.stats")
    for df, value in reproduce.T_975.items():
        assert value == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4), df
    for df in (35, 45, 100, 500):  # between table entries: the next smaller df, never narrower
        assert reproduce.t_critical(df, 0.95) >= stats.t.ppf(0.975, df)
    with pytest.raises(ValueError, match="degrees of freedom"):
        reproduce.t_critical(0)


def test_99_table_matches_scipy_and_excludes_zero_reads_both_levels():
    stats = pytest.importorskip("scipy.stats")
    assert set(reproduce.T_995) == set(reproduce.T_975)
    for df, value in reproduce.T_995.items():
        assert value == pytest.approx(stats.t.ppf(0.995, df), abs=6e-4), df
    for df in (35, 45, 100, 500):
        assert reproduce.t_critical(df, 0.99) >= stats.t.ppf(0.995, df)
    assert reproduce.t_critical(9, 0.99) == 3.250  # the design's 10 seeds
    # [0.5, 0.7, 0.9] at 99 %: 9.925 · 0.2 / √3 = 1.1460403
    assert reproduce.mean_ci([0.5, 0.7, 0.9], 0.99) == pytest.approx((0.7, 1.1460403), abs=1e-6)
    # [1.0, 1.5, 2.0]: s = 0.5; 95 %: 4.303 · 0.5 / √3 = 1.2421 < 1.5; 99 %: 9.925 · 0.5 / √3 = 2.8651 > 1.5
    assert reproduce.excludes_zero([1.0, 1.5, 2.0], 0.95) is True
    assert reproduce.excludes_zero([1.0, 1.5, 2.0], 0.99) is False
    assert reproduce.excludes_zero([-1.0, -1.0, -1.0], 0.99) is True  # no spread, a clear sign
    assert reproduce.excludes_zero([0.3], 0.95) is None
    # Paired by seed (seed 3 has no reference): differences 0.010, 0.015, 0.020 -> 99 % half-width 2.9 points
    row, reference = {0: 0.51, 1: 0.515, 2: 0.52, 3: 0.9}, {0: 0.5, 1: 0.5, 2: 0.5}
    assert reproduce.robustness(row, reference) == "yes / no (99 %: ± 2.9)"
    assert reproduce.robustness({0: 0.6}, reference) == "—"


def test_run_scores_final_max_and_normalised_area():
    lines = [{"step": 0, "stage": "sft", "sft/nll": 3.0}, {"step": 0, "eval/success_rate": 0.5},
             {"step": 10, "train/reward_mean": 0.1}, {"step": 10, "eval/success_rate": 0.7},
             {"step": 30, "eval/success_rate": 0.6}]  # fmt: skip
    scores = reproduce.run_scores(lines)
    # area: (0.5+0.7)/2·10 + (0.7+0.6)/2·20 = 6 + 13 = 19, over 30 steps
    assert scores == pytest.approx({"final": 0.6, "max": 0.7, "auc": 19 / 30})


DIAGNOSTIC_LINES = [
    {"step": 0, "stage": "sft", "sft/nll": 1.0},
    {"step": 0, "stage": "value_pretrain", "value_pretrain/epoch": 0, "critic/explained_variance": 0.1,
     "critic/grad_norm/experts": 50.0},
    {"step": 0, "stage": "value_pretrain", "value_pretrain/epoch": 1, "critic/explained_variance": 0.3,
     "critic/grad_norm/experts": 50.0},
    {"step": 0, "eval/success_rate": 0.2, "eval/tool_share/est": 0.9, "eval/success_rate/level_1": 0.5},
    {"step": 1, "train/critic_warmup": 1, "critic/before_updates/explained_variance": -9.0, "critic/grad_norm/experts": 1.0},
    {"step": 2, "train/critic_warmup": 0, "critic/before_updates/explained_variance": 0.9, "critic/grad_norm/experts": 2.0,
     "policy/advantage_mean": 0.1},
    {"step": 3, "train/critic_warmup": 0, "critic/before_updates/explained_variance": 0.1, "critic/grad_norm/experts": 3.0,
     "policy/advantage_mean": 0.3, "eval/success_rate": 0.5, "eval/tool_share/est": 0.4},
    {"step": 4, "train/critic_warmup": 0, "critic/before_updates/explained_variance": 0.5, "critic/grad_norm/experts": 6.0,
     "policy/advantage_mean": -0.1},
    {"step": 5, "train/critic_warmup": 0, "critic/before_updates/explained_variance": 0.7, "critic/grad_norm/experts": 8.0,
     "policy/advantage_mean": 0.1},
]  # fmt: skip


def test_per_run_diagnostics_against_hand_computation():
    lines = DIAGNOSTIC_LINES
    # RL lines: steps 1-5 (the warm-start stages and the step-0 evaluation are not RL steps).
    assert [line["step"] for line in reproduce.rl_lines(lines)] == [1, 2, 3, 4, 5]
    # Warmup: the config's critic.warmup_steps; without a config, the last step flagged train/critic_warmup.
    assert reproduce.critic_warmup_steps(lines, {"critic": {"warmup_steps": 2}}) == 2
    assert reproduce.critic_warmup_steps(lines) == 1 and reproduce.critic_warmup_steps(lines[:4]) == 0
    # A run that warmed its critic up before RL step 1 has no warmup RL steps, whatever its config says.
    unflagged = [{k: v for k, v in line.items() if k != "train/critic_warmup"} for line in lines]
    assert reproduce.critic_warmup_steps(unflagged, {"critic": {"warmup_steps": 2}}) == 0
    key = "critic/before_updates/explained_variance"
    assert reproduce.median_after_warmup(lines, key, 1) == pytest.approx(0.6)  # median(0.9, 0.1, 0.5, 0.7)
    assert reproduce.median_after_warmup(lines, key, 0) == pytest.approx(0.5)  # median(−9, 0.9, 0.1, 0.5, 0.7)
    assert reproduce.median_after_warmup(lines, key, 5) is None
    # Mean over RL steps: the value-pretraining lines' norms (50) stay out; the warmup step counts.
    assert reproduce.rl_mean(lines, "critic/grad_norm/experts") == pytest.approx((1 + 2 + 3 + 6 + 8) / 5)
    assert reproduce.rl_mean(lines, "policy/advantage_mean") == pytest.approx(0.1)  # (0.1 + 0.3 − 0.1 + 0.1) / 4
    assert reproduce.rl_mean(lines, "policy/masked_fraction") is None
    assert reproduce.last_stage_value(lines, "value_pretrain", "critic/explained_variance") == 0.3
    # The first RL steps that log a key: the warm start's policy entropy, SFT's stage lines left out.
    entropy = "policy/kept_entropy_mean"
    early = [{"step": 0, "stage": "sft", entropy: 9.0}, {"step": 1, entropy: 0.2}, {"step": 2}, {"step": 3, entropy: 0.4},
             {"step": 4, entropy: 0.9}]  # fmt: skip
    assert reproduce.first_steps_mean(early, entropy, 1) == pytest.approx(0.2)
    assert reproduce.first_steps_mean(early, entropy, 2) == pytest.approx(0.3)
    assert reproduce.first_steps_mean(early, entropy, 5) == pytest.approx(0.5)
    assert reproduce.first_steps_mean(early[:1], entropy, 5) is None
    assert reproduce.last_stage_value(lines, "sft", "critic/explained_variance") is None
    # The last evaluation is step 3's; level_1 was logged at step 0 only.
    assert reproduce.at_last_eval(lines, "eval/tool_share/est") == 0.4
    assert reproduce.at_last_eval(lines, "eval/success_rate/level_1") is None
    assert reproduce.at_last_eval(lines[:3], "eval/tool_share/est") is None


def test_the_report_leaves_out_explained_variances_fit_metrics_cannot_give_and_the_archive_keeps_them(tmp_path):
    from sao_jax.diagnostics import EXPLAINED_VARIANCE_FLOOR

    ev, before = "critic/explained_variance", "critic/before_updates/explained_variance"
    lines = [{"step": 0, "stage": "value_pretrain", ev: -1.6e15, "critic/mse": 0.09},
             {"step": 0, "stage": "value_pretrain", ev: EXPLAINED_VARIANCE_FLOOR},  # the bound itself is possible
             {"step": 1, before: -3.0, "policy/advantage_mean": -1e16},  # only explained variances are bounded
             {"step": 2, before: -1e16}]  # fmt: skip
    assert reproduce.without_impossible_fits(lines) == [
        {"step": 0, "stage": "value_pretrain", "critic/mse": 0.09},
        {"step": 0, "stage": "value_pretrain", ev: EXPLAINED_VARIANCE_FLOOR},
        {"step": 1, before: -3.0, "policy/advantage_mean": -1e16}, {"step": 2}]  # fmt: skip
    folder = reproduce.run_dir(tmp_path / "runs", "chain", "step_average", 0)
    write_run(folder, [(0, 0.2), (5, 0.5)], extra=lines[:1], config={})
    loaded = reproduce.load_runs(tmp_path / "runs", "chain", "step_average")[0]
    assert reproduce.last_stage_value(loaded, "value_pretrain", ev) is None
    assert reproduce.last_stage_value(loaded + lines[1:2], "value_pretrain", ev) == EXPLAINED_VARIANCE_FLOOR
    reproduce.archive_runs(tmp_path / "runs", "chain", tmp_path / "kept")
    kept = reproduce.read_run_metrics(reproduce.run_dir(tmp_path / "kept", "chain", "step_average", 0))
    assert kept[-1][ev] == -1.6e15


def write_run(folder, evals, *, finished=True, extra=(), config=None):
    folder.mkdir(parents=True)
    lines = [{"step": 0, "stage": "sft", "sft/nll": 2.0}]
    lines += [{"step": s, "eval/success_rate": v} for s, v in evals]
    lines += list(extra)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    if finished:
        (folder / "summary.json").write_text("{}")


def markdown_table(report, first_header):
    """{first cell: [cells]} of the table whose header row starts with `first_header`."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header}"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return [c.strip() for c in lines[start].strip("|").split("|")], rows


def test_report_table_from_synthetic_metrics(tmp_path):
    finals = {"token_level": [0.89, 0.90, 0.91], "step_average": [0.69, 0.70, 0.71], "step_last_token": [0.95, 0.96, 0.97]}
    for row, values in finals.items():
        for seed, final in enumerate(values):
            write_run(tmp_path / "table5" / row / f"seed{seed}", [(0, 0.5), (10, 0.7), (30, final)])
    # An unfinished run (no summary.json) is left out of the table.
    write_run(tmp_path / "table5" / "token_level" / "seed3", [(0, 0.0), (10, 0.0)], finished=False)
    report = reproduce.write_report("table5", tmp_path).read_text()
    by_row = {line.split("`")[1].removesuffix(".yaml"): [c.strip() for c in line.strip("|").split("|")]
              for line in report.splitlines() if line.startswith("| ") and ".yaml`" in line}  # fmt: skip
    # final: mean ± 4.303 · 0.01 / √3 = ±0.0248 -> "90.0 ± 2.5"; max = max(0.7, final);
    # AUC = (6 + (0.7 + f)/2 · 20) / 30 = (13 + 10 f) / 30 -> 73.3 ± 0.8 for f = 0.90
    assert set(by_row) == set(finals)
    assert by_row["token_level"][2:6] == ["3", "90.0 ± 2.5", "90.0 ± 2.5", "73.3 ± 0.8"]
    # max of step_average: [0.70, 0.70, 0.71]: 70.33, s = 0.0057735 -> ± 4.303 · 0.0057735 / √3 = 0.0143
    # Δ is paired by seed: 0.69 − 0.89, 0.70 − 0.90, 0.71 − 0.91 -> −20.0 ± 0.0
    assert by_row["step_average"][2:7] == ["3", "70.0 ± 2.5", "70.3 ± 1.4", "66.7 ± 0.8", "-20.0 ± 0.0"]
    # A constant paired difference excludes 0 at both levels.
    # paper 85.8 < 89.8 and ours 70 < 90
    assert by_row["step_average"][7:] == ["yes / yes (99 %: ± 0.0)", "85.8", "agrees"]
    assert by_row["step_last_token"][6:] == ["+6.0 ± 0.0", "yes / yes (99 %: ± 0.0)", "87.3", "disagrees"]
    assert (tmp_path / "table5" / "success.png").stat().st_size > 0
    # Per seed: start→end and AUC; seed 3 of token_level is unfinished, so no seed 3 column.
    header, per_seed = markdown_table(report, "row | seed 0")
    assert header == ["row", "seed 0", "seed 1", "seed 2"]
    assert per_seed["step-average"] == ["50.0→69.0 (AUC 66.3)", "50.0→70.0 (AUC 66.7)", "50.0→71.0 (AUC 67.0)"]
    # No diagnostic key in these metrics: no diagnostics table, no gradient-norm plot.
    assert "Mechanism diagnostics" not in report and not (tmp_path / "table5" / "success_grad_norms.png").exists()


def chain_run_lines(seed, row):
    """RL steps 1-5 (critic warmup 2 in the config) of a synthetic chain run; evaluations at steps 0 and 5."""
    lines = [{"step": 0, "eval/success_rate": 0.2, "eval/tool_share/est": 0.6, "eval/success_rate/level_1": 0.5,
              "eval/success_rate/level_2": 0.0}]  # fmt: skip
    for step in range(1, 6):
        line = {"step": step, "train/critic_warmup": int(step <= 2)}
        if row == "sao":
            explained = [[-9, -9, 0.9, 0.1, 0.4], [-9, -9, 0.5, 0.2, 0.1]][seed][step - 1]
            line |= {"critic/before_updates/explained_variance": explained, "critic/grad_norm/attention": 0.0,
                     "critic/grad_norm/experts": float(step + seed)}  # fmt: skip
            if step > 2:
                line |= {"policy/masked_fraction": 0.0,
                         "policy/advantage_mean": [[0.1, 0.2, 0.3], [0.0, 0.0, 0.3]][seed][step - 3]}  # fmt: skip
        else:
            line |= {"policy/masked_fraction": [0.0, 0.01][seed] * (step - 1) / 2,
                     "policy/advantage_mean": 0.4 + 0.1 * seed}  # fmt: skip
        lines.append(line)
    last = {"sao": [0.6, 0.7], "running_mean": [0.8, 0.85]}[row][seed]
    lines.append({"step": 5, "eval/success_rate": last, "eval/tool_share/est": [0.1, 0.3][seed],
                  "eval/success_rate/level_1": 1.0, "eval/success_rate/level_2": [0.2, 0.4][seed],
                  **({"eval/success_rate/level_10": 0.0} if (row, seed) == ("sao", 1) else {})})  # fmt: skip
    if row == "sao":
        lines[:0] = [{"step": 0, "stage": "value_pretrain", "value_pretrain/epoch": e,
                      "critic/explained_variance": [0.1, 0.3 + 0.1 * seed][e]} for e in (0, 1)]  # fmt: skip
    return lines


def test_chain_report_gives_per_seed_results_robustness_and_mechanism_diagnostics(tmp_path):
    for row, warmup in (("sao", 2), ("running_mean", 0)):
        for seed in range(2):
            write_run(tmp_path / "chain" / row / f"seed{seed}", [], extra=chain_run_lines(seed, row),
                      config={"critic": {"warmup_steps": warmup}})  # fmt: skip
    report = reproduce.write_report("chain", tmp_path).read_text()
    _, main = markdown_table(report, "row | config")
    # running mean − SAO by seed: +0.20, +0.15: 95 %: 12.706 · 0.035355 / √2 = 0.318 > 0.175; 99 %: 63.657 · 0.025
    assert main["Running-mean baseline"][5:7] == ["+17.5 ± 31.8", "no / no (99 %: ± 159.1)"]
    assert main["w/o faster value"][1:7] == ["0", "not run", "not run", "not run", "—", "—"]

    _, per_seed = markdown_table(report, "row | seed 0")
    assert per_seed["SAO (token-level GAE)"] == ["20.0→60.0 (AUC 40.0)", "20.0→70.0 (AUC 45.0)"]
    assert per_seed["GRPO+DIS (group of 8)"] == ["—", "—"]

    header, diag = markdown_table(report, "row | runs")
    assert header == ["row", "runs", "critic EV before updates", "critic EV, end of value pretraining",
                      "critic ‖∇‖ attention", "critic ‖∇‖ experts", "masked fraction %", "advantage mean",
                      "estimator share % (last eval)", "level 1 success % (last eval)",
                      "level 2 success % (last eval)", "level 10 success % (last eval)"]  # fmt: skip
    # Per run, then mean ± 12.706 · s / √2 over the two seeds (half = 12.706 · |a − b| / 2):
    # EV median after warmup 2: median(0.9, 0.1, 0.4) = 0.4, median(0.5, 0.2, 0.1) = 0.2 -> 0.30 ± 1.27;
    # last value-pretraining epoch: 0.3, 0.4 -> 0.35 ± 0.64; experts: mean(1..5) = 3, mean(2..6) = 4 -> 3.5 ± 6.35;
    # advantage: 0.2, 0.1 -> 0.150 ± 0.635; estimator share 10, 30 % -> 20.0 ± 127.1; level 2: 20, 40 % -> 30.0 ± 127.1;
    # level 10 is logged by one run only.
    assert diag["SAO (token-level GAE)"] == ["2", "0.30 ± 1.27", "0.35 ± 0.64", "0 exactly", "3.5 ± 6.35", "0 exactly",
                                             "0.150 ± 0.635", "20.0 ± 127.1", "100.0 ± 0.0", "30.0 ± 127.1",
                                             "0.0 (1/2 runs)"]  # fmt: skip
    # The critic-free row has no critic columns; its masked fraction is 0 in one run only: 0, 1 % -> 0.50 ± 6.35.
    assert diag["Running-mean baseline"] == ["2", "—", "—", "—", "—", "0.50 ± 6.35", "0.450 ± 0.635",
                                             "20.0 ± 127.1", "100.0 ± 0.0", "30.0 ± 127.1", "—"]  # fmt: skip
    assert diag["step-average GAE"] == ["0", *["not run"] * 10]
    assert "- critic EV before updates: the run's median" in report

    runs = {name: reproduce.load_runs(tmp_path, "chain", name) for name in ("sao", "running_mean")}
    assert reproduce.grad_norm_panels(runs) == ([["critic/grad_norm/experts"]], ["critic/grad_norm/attention"])
    assert (tmp_path / "chain" / "success_grad_norms.png").stat().st_size > 0
    assert "![success_grad_norms](chain/success_grad_norms.png)" in report


def test_the_pretraining_curve_pairs_each_seeds_critic_fit_with_its_final_success(tmp_path):
    """The critic suite's corpus curve: rows by `critic.pretrain_rollouts`, each seed's EV at the end
    of value pretraining beside its final success; a run without value pretraining has no EV, and a
    seed whose EV is missing does not shift the others' pairs."""
    ev = "critic/explained_variance"
    runs_of = {  # row: (corpus, {seed: (EV at the last pretraining epoch or None, final success)})
        "sao": (4096, {0: (0.6, 0.8), 1: (None, 0.7), 2: (0.5, 0.9)}),
        "sao_pretrain256": (256, {0: (0.3, 0.6), 1: (0.4, 0.5)}),
        "sao_pretrain0": (0, {0: (None, 0.4), 1: (None, 0.45)}),
    }
    for row, (corpus, seeds) in runs_of.items():
        for seed, (fit, final) in seeds.items():
            pretraining = [] if fit is None else [{"step": 0, "stage": "value_pretrain", ev: fit - 0.2},
                                                  {"step": 0, "stage": "value_pretrain", ev: fit}]  # fmt: skip
            write_run(tmp_path / "critic" / row / f"seed{seed}", [(0, 0.2), (5, final)], extra=pretraining,
                      config={"critic": {"pretrain_rollouts": corpus, "warmup_steps": 0}})  # fmt: skip
    comparison = next(c for c in reproduce.SUITES["critic"].comparisons if c.pretraining_curve)
    runs = {row: reproduce.load_runs(tmp_path, "critic", row) for row in runs_of}
    assert reproduce.pretraining_points(comparison, runs, tmp_path, "critic") == [
        (0, "no value pretraining", [(None, 0.4), (None, 0.45)]),
        (256, "256 pretraining rollouts", [(0.3, 0.6), (0.4, 0.5)]),
        (4096, "SAO", [(0.6, 0.8), (None, 0.7), (0.5, 0.9)]),
    ]  # the 1,024 row has no finished run: no point
    report = reproduce.write_report("critic", tmp_path).read_text()
    assert (tmp_path / "critic" / "pretraining_curve.png").stat().st_size > 0
    assert "![pretraining_curve](critic/pretraining_curve.png)" in report


def test_report_without_any_run_folder_says_not_run(tmp_path):
    report = reproduce.write_report("table4", tmp_path).read_text()
    _, main = markdown_table(report, "row | config")
    assert main["SAO"][1:7] == ["0", "not run", "not run", "not run", "—", "—"]
    assert "| row | seed" not in report and "Mechanism diagnostics" not in report


def test_direction_pairs_seeds_and_says_when_the_difference_interval_holds_zero(tmp_path):
    comparison = reproduce.SUITES["table4"].comparisons[0]
    rows = {r.name: r for r in comparison.rows}
    finals = {"sao": {0: 0.8, 1: 0.9, 2: 0.7}, "no_faster_value": {0: 0.9, 1: 0.85}, "grpo_dis": {0: 0.5}}
    # no_faster_value − sao over seeds 0, 1: [+0.10, −0.05]: mean +0.025, half 12.706 · 0.106 / √2 = 0.95
    assert reproduce.direction(comparison, rows["no_faster_value"], finals) == "disagrees (Δ CI includes 0)"
    assert reproduce.direction(comparison, rows["grpo_dis"], finals) == "agrees (1 seed)"  # SWE-Bench column
    assert reproduce.direction(comparison, rows["running_mean"], finals) == "—"  # not run
    # Seeds differ a lot, the paired difference does not: a consistent −0.05 is a clear direction.
    finals["running_mean"] = {0: 0.75, 1: 0.85, 2: 0.65}
    assert reproduce.direction(comparison, rows["running_mean"], finals) == "agrees"
    finals["vanilla_vapo"] = {0: 0.9, 1: 0.8}
    assert reproduce.direction(comparison, rows["vanilla_vapo"], finals) == "tie (Δ CI includes 0)"
    assert reproduce.paired_difference({0: 0.5}, {1: 0.4})[2] == 0  # no seed in common


def style_lines(targets, shares):
    return [{"step": s, "train/target_style": t, **{f"train/style_share/{k}": v for k, v in share.items()}}
            for s, (t, share) in enumerate(zip(targets, shares), start=1)]


def test_realignment_counts_steps_until_the_new_style_holds_a_majority_for_five_steps():
    # Steps 1-10 cute; step 11 switches to classical, which reaches ≥ 0.5 from step 14 on (with a dip
    # at step 13 before it); step 21 switches to chuunibyou, which never holds five steps running.
    targets = ["cute"] * 10 + ["classical"] * 10 + ["chuunibyou"] * 6
    classical = [0.0] * 10 + [0.2, 0.6, 0.4, 0.5, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9] + [0.9] * 6
    chuuni = [0.0] * 20 + [0.6, 0.6, 0.6, 0.6, 0.1, 0.6]
    shares = [{"classical": a, "chuunibyou": b, "cute": 1 - a - b} for a, b in zip(classical, chuuni)]
    found = reproduce.realignment(style_lines(targets, shares))
    assert found == [{"switch_step": 11, "style": "classical", "held_majority": False, "steps": 3, "window": 10},
                     {"switch_step": 21, "style": "chuunibyou", "held_majority": True, "steps": None, "window": 6}]  # fmt: skip
    # Chuunibyou already held 0.6 of the switch step's trajectories: that switch tests nothing.
    assert reproduce.realigned_share(style_lines(targets, shares)) == 1.0  # 1 of the 1 switch that counts
    chuuni_late = [0.0] * 20 + [0.1, 0.6, 0.6, 0.6, 0.1, 0.6]
    late = [{"classical": a, "chuunibyou": b, "cute": 1 - a - b} for a, b in zip(classical, chuuni_late)]
    assert reproduce.realigned_share(style_lines(targets, late)) == 0.5  # 1 of 2: chuunibyou never holds 5 steps
    # Steps to realign: classical 3, chuunibyou never, so it counts as its whole 6-step phase.
    assert reproduce.realign_steps(style_lines(targets, late)) == (3 + 6) / 2
    assert reproduce.realign_steps(style_lines(targets, shares)) == 3.0  # the held switch is left out
    assert reproduce.realigned_share(style_lines(["cute"] * 3, [{"cute": 1.0}] * 3)) is None  # no switch


def test_online_and_keep_rule_reports_from_synthetic_metrics(tmp_path):
    targets = ["cute"] * 4 + ["classical"] * 8
    for row, delay in (("sao", 1), ("running_mean", 3)):
        for seed in range(2):
            shares = [{"cute": 0.9, "classical": 0.1}] * 4 + [
                {"cute": 0.8, "classical": 0.2} if i < delay else {"cute": 0.1, "classical": 0.9} for i in range(8)]
            write_run(tmp_path / "online" / row / f"seed{seed}", [(0, 0.3), (12, 0.8)],
                      extra=style_lines(targets, shares))
    report = reproduce.write_report("online", tmp_path).read_text()
    realign = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in report.splitlines()
               if line.startswith("| ") and "realigned)" in line}  # fmt: skip
    assert realign == {"SAO": "1.0 ± 0.0 (2/2 realigned)", "running mean (global, 128)": "3.0 ± 0.0 (2/2 realigned)"}
    assert "| running mean (global, 128) | 2 | 100.0 ± 0.0 | +0.0 ± 0.0 | 3.0 ± 0.0 | +2.0 ± 0.0 |" in report.splitlines()
    assert (tmp_path / "online" / "style_share.png").stat().st_size > 0

    for row, fraction in (("dis", [0.0, 0.01, 0.02]), ("estr", [0.1, 0.2, 0.3])):
        for seed, f in enumerate(fraction):
            write_run(tmp_path / "open" / row / f"seed{seed}", [(0, 0.5), (4, 0.6)],
                      extra=[{"step": s, "policy/masked_fraction": f * s, "policy/masked_entropy_mean": 1.0}
                             for s in (1, 2, 3)])  # fmt: skip
    steps, mean, half = reproduce.per_step(
        [reproduce.load_runs(tmp_path, "open", "estr")[k] for k in range(3)], "policy/masked_fraction")
    assert steps.tolist() == [1, 2, 3]
    assert mean == pytest.approx([0.2, 0.4, 0.6]) and half == pytest.approx([s * 0.2484339 for s in (1, 2, 3)], abs=1e-6)
    reproduce.write_report("open", tmp_path)
    assert (tmp_path / "open" / "keep_rule.png").stat().st_size > 0


def hetero_run(folder, *, advantages, ev=None):
    """A synthetic online_hetero run: cute rewarded on steps 1-12, classical from step 13 (one switch);
    held-out evaluations at 0, 6, 12 (the cute phase) and 18, 24 (the classical phase), two levels;
    `advantages`: (cute, classical, chuunibyou) first-action advantages before the switch and after;
    `ev`: the critic's explained variance before its updates on steps 8-12 and 13-17 (0.5 elsewhere)."""
    evals = [(0, 0.3), (6, 0.5), (12, 0.7), (18, 0.2), (24, 0.6)]
    lines = []
    for step, success in evals:
        lines.append({"step": step, "eval/success_rate": success, "eval/success_rate/level_1": success + 0.2,
                      "eval/success_rate/level_2": success - 0.2, "eval/quality_rate/level_1": 0.8 + step / 240,
                      "eval/quality_rate/level_2": 0.1})  # fmt: skip
    for step in range(1, 25):
        after = step >= 13
        line = {"step": step, "train/target_style": "classical" if after else "cute",
                "train/style_share/classical": 0.9 if step >= 15 else 0.1, "train/style_share/cute": 0.1}
        for style, (before_value, after_value) in zip(("cute", "classical", "chuunibyou"), advantages):
            value = after_value if after else before_value
            line[f"train/first_action_advantage/{style}"] = value
        if ev is not None:
            line["critic/before_updates/explained_variance"] = ev[0] if 8 <= step <= 12 else ev[1] if 13 <= step <= 17 else 0.5
        lines.append(line)
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text("{}")


def test_online_hetero_report_per_phase_around_switches_and_by_style(tmp_path):
    for seed in range(2):
        hetero_run(tmp_path / "online_hetero" / "sao" / f"seed{seed}",
                   advantages=((0.1, -0.4), (-0.2, 0.3), (None, -0.1)), ev=(0.8, -1.0))
        hetero_run(tmp_path / "online_hetero" / "running_mean_batch" / f"seed{seed}",
                   advantages=((0.1, -0.2 - 0.1 * seed), (-0.2, 0.3), (None, -0.1)))
    report = reproduce.write_report("online_hetero", tmp_path).read_text()
    header, phase = markdown_table(report, "row | cute from step 0")
    assert header == ["row", "cute from step 0", "classical from step 13"]
    assert phase == {"SAO": ["30.0 → 70.0 ± 0.0", "20.0 → 60.0 ± 0.0"],
                     "running mean (global, one batch = 32)": ["30.0 → 70.0 ± 0.0", "20.0 → 60.0 ± 0.0"],
                     "running mean (global, 128)": ["not run", "not run"]}  # fmt: skip
    # Level 1 at the phase ends: (0.9 + 0.8) / 2; level 2: (0.5 + 0.4) / 2. Quality: 0.8 → 0.9 and 0.1 → 0.1.
    _, levels = markdown_table(report, "row | level 1: success at phase ends")
    assert levels["SAO"] == ["85.0 ± 0.0", "45.0 ± 0.0", "80.0 → 90.0", "10.0 → 10.0"]
    # EV: steps 8-12 before the switch, 13-17 from it; the median of 5 × −1, 14 × 0.5, 5 × 0.8 is 0.5.
    _, critic = markdown_table(report, "row | 5 steps before each switch")
    assert critic == {"SAO": ["0.80 ± 0.00", "-1.00 ± 0.00", "0.50 ± 0.00"],
                      "running mean (global, one batch = 32)": ["—", "—", "—"],
                      "running mean (global, 128)": ["—", "—", "—"]}  # fmt: skip
    header, advantage = markdown_table(report, "row | old style, 10 steps before the switch")
    assert header[1:] == [f"{role} style, 10 steps {when}" for when in ("before the switch", "from it")
                          for role in ("old", "new", "other")]  # fmt: skip
    assert advantage["SAO"] == ["0.100 ± 0.000", "-0.200 ± 0.000", "—", "-0.400 ± 0.000", "0.300 ± 0.000",
                                "-0.100 ± 0.000"]  # fmt: skip
    # Seeds 0 and 1 of the running mean: old style after the switch −0.2 and −0.3, t_{0.975,1} · s/√2 = 0.635.
    assert advantage["running mean (global, one batch = 32)"][3] == "-0.250 ± 0.635"
    assert advantage["running mean (global, 128)"] == ["—"] * 6
    # Steps to realign: classical holds ≥ 50 % from step 15, two steps after its switch.
    assert "2.0 ± 0.0 (2/2 realigned)" in report
    for plot in ("style_share.png", "first_action_advantage.png", "success.png"):
        assert (tmp_path / "online_hetero" / plot).stat().st_size > 0


def test_phases_start_with_the_first_style_at_step_0_and_one_per_switch():
    lines = style_lines(["cute"] * 3 + ["classical"] * 2 + ["chuunibyou"] * 2, [{"cute": 1.0}] * 7)
    assert reproduce.phases(lines) == [{"start": 0, "end": 4, "style": "cute", "previous": None},
                                       {"start": 4, "end": 6, "style": "classical", "previous": "cute"},
                                       {"start": 6, "end": None, "style": "chuunibyou", "previous": "classical"}]  # fmt: skip
    assert reproduce.role_style(reproduce.phases(lines)[2], "other") == "cute"
    values = [dict(line, x=float(line["step"])) for line in lines]
    # Offsets −2..1 around the switch at 4 stay inside the phases either side of it (3 < 4 and 4, 5 < 6).
    assert reproduce.aligned_values(values, lambda phase: "x", range(-2, 2)) == [
        {-2: 2.0, -1: 3.0, 0: 4.0, 1: 5.0}, {-2: 4.0, -1: 5.0, 0: 6.0, 1: 7.0}]


# --------------------------------------------------------------------------------- running suites


class StubTrain:
    """Records each call and writes what a finished run leaves behind."""

    def __init__(self, fail_on=()):
        self.calls, self.fail_on = [], fail_on

    def __call__(self, config, *, resume):
        self.calls.append((config, resume))
        out = pathlib.Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        if any(name in config.output_dir for name in self.fail_on):
            raise RuntimeError("interrupted")
        (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/success_rate": 0.5}) + "\n")
        (out / "summary.json").write_text("{}")
        return {}


def test_finished_runs_are_skipped_and_interrupted_ones_resumed(tmp_path):
    train = StubTrain()
    outcome = reproduce.run_suite("table5", 2, tmp_path, train_fn=train, log=lambda _: None)
    assert len(outcome["ran"]) == 6 and not outcome["failed"]
    assert sorted((c.output_dir, c.seed, resume) for c, resume in train.calls) == sorted(
        (str(tmp_path / "table5" / row / f"seed{k}"), k, False)
        for row in ("token_level", "step_average", "step_last_token") for k in (0, 1))  # fmt: skip

    train.calls.clear()
    outcome = reproduce.run_suite("table5", 2, tmp_path, train_fn=train, log=lambda _: None)
    assert len(outcome["skipped"]) == 6 and train.calls == []

    (tmp_path / "table5" / "step_average" / "seed1" / "summary.json").unlink()  # killed before the end
    outcome = reproduce.run_suite("table5", 2, tmp_path, train_fn=train, log=lambda _: None)
    assert outcome["resumed"] == [str(tmp_path / "table5" / "step_average" / "seed1")]
    assert [(c.output_dir, resume) for c, resume in train.calls] == [(outcome["resumed"][0], True)]


def test_rows_runs_only_the_named_rows_and_rejects_unknown_ones(tmp_path):
    train = StubTrain()
    outcome = reproduce.run_suite("table5", 2, tmp_path, train_fn=train, log=lambda _: None,
                                  rows=["step_last_token"])
    assert sorted(outcome["ran"]) == [str(tmp_path / "table5" / "step_last_token" / f"seed{k}") for k in (0, 1)]
    with pytest.raises(ValueError, match=r"no row\(s\) \['step_lst'\].*step_last_token"):
        reproduce.run_suite("table5", 1, tmp_path, train_fn=train, rows=["step_lst"])


def test_a_folder_of_another_config_is_an_error_and_a_failing_row_does_not_stop_the_suite(tmp_path):
    train = StubTrain(fail_on=("step_average",))
    messages = []
    outcome = reproduce.run_suite("table5", 1, tmp_path, train_fn=train, log=messages.append)
    assert outcome["failed"] == [str(tmp_path / "table5" / "step_average" / "seed0")]
    assert len(outcome["ran"]) == 2 and any("interrupted" in m for m in messages)

    messages.clear()
    outcome = reproduce.run_suite("table5", 1, tmp_path, overrides=["train.steps=7"], train_fn=StubTrain(),
                                  log=messages.append)  # fmt: skip
    assert len(outcome["failed"]) == 3
    assert any("differs in train.steps" in m for m in messages)


class InterruptedTrain(StubTrain):
    """A stub whose run of `stop_on` stops as a signal stops `train`: step 4 saved, `Interrupted`."""

    def __init__(self, stop_on):
        super().__init__()
        self.stop_on = stop_on

    def __call__(self, config, *, resume):
        if self.stop_on in config.output_dir:
            self.calls.append((config, resume))
            raise Interrupted(signal.SIGTERM, 4)
        return super().__call__(config, resume=resume)


def test_a_signal_stops_the_suite_after_the_run_in_hand_and_exits_143_in_one_line(tmp_path, monkeypatch, capsys):
    import jax

    from sao_jax.train import loop

    train = InterruptedTrain("step_average")  # the second of table5's three rows
    monkeypatch.setattr(loop, "train", train)
    cache_dir = jax.config.jax_compilation_cache_dir  # `main` points it at OUT/.jax_cache
    try:
        status = reproduce.main(["--suite", "table5", "--seeds", "2", "--out", str(tmp_path)])
    finally:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    assert status == 143
    ran = [pathlib.Path(c.output_dir).relative_to(tmp_path).as_posix() for c, _ in train.calls]
    assert ran == ["table5/token_level/seed0", "table5/token_level/seed1", "table5/step_average/seed0"]
    out, err = capsys.readouterr()
    assert f"stopped  {tmp_path / 'table5' / 'step_average' / 'seed0'}" in out.splitlines()
    assert err.splitlines() == ["interrupted by SIGTERM at RL step 4, saved; rerun the same command to resume the suite"]
    assert not (tmp_path / "table5.md").exists()  # no report of a suite cut short


def test_status_shows_each_run_done_started_at_its_rl_step_or_not_started(tmp_path, capsys):
    done = reproduce.run_dir(tmp_path, "table5", "token_level", 0)
    done.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    started = reproduce.run_dir(tmp_path, "table5", "step_average", 1)
    started.mkdir(parents=True)
    (started / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 200}}))
    lines = [{"stage": "sft", "step": 0, "sft/loss": 1.0}, {"step": 0, "eval/success_rate": 0.2},
             {"step": 1, "policy/loss": 0.1}, {"step": 2, "policy/loss": 0.1}, {"step": 2, "eval/success_rate": 0.3}]
    (started / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "pol')
    warming = reproduce.run_dir(tmp_path, "table5", "step_last_token", 0)
    warming.mkdir(parents=True)
    (warming / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 50}}))
    assert reproduce.main(["--suite", "table5", "--seeds", "2", "--out", str(tmp_path), "--status"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| row | seed 0 | seed 1 |",
        "|---|---|---|",
        "| token_level | done | · |",
        "| step_average | · | 2/200 |",
        "| step_last_token | 0/50 | · |",
        "",
        f"table5 under {tmp_path}: 1 of 6 runs done, 2 started, 3 not started",
    ]
    assert not (tmp_path / "table5.md").exists()


def test_quick_caps_budgets_but_keeps_a_critic_free_row_without_value_pretraining(tmp_path):
    train = StubTrain()
    reproduce.run_suite("table4", 1, tmp_path, quick=True, train_fn=train, log=lambda _: None)
    configs = {pathlib.Path(c.output_dir).parent.name: c for c, _ in train.calls}
    assert configs["sao"].train.steps == 6 and configs["sao"].critic.pretrain_rollouts == 16
    assert configs["sao"].sft.steps == 20 and configs["sao"].env.eval_prompts == 16
    assert configs["running_mean"].critic.pretrain_rollouts == 0
    assert configs["grpo_dis"].train.batch_size == 8 and configs["grpo_dis"].advantage.group_size == 8


TINY = ["model.preset=tiny_qwen3_moe", "env.difficulty=[1]", "rollout.max_total_tokens=64",
        "rollout.max_action_tokens=24", "rollout.num_slots=4", "sft.steps=4", "critic.pretrain_rollouts=8",
        "train.batch_size=8",
        "train.steps=3", "train.eval_every=3", "env.eval_prompts=8"]  # fmt: skip


@pytest.mark.slow
def test_quick_run_of_the_estr_row_calibrates_tau_trains_and_reports(tmp_path):
    """The open suite's ESTR row end to end with the real trainer (async), on tiny budgets."""
    from sao_jax.train.loop import train

    path = reproduce.config_file("open", "estr")
    overrides = [*reproduce.quick_overrides(load_config(path, TINY), reproduce.SUITES["open"]), *TINY]
    output_dir = reproduce.run_dir(tmp_path, "open", "estr", 0)
    status = reproduce.run_one(path, output_dir, 0, overrides, train_fn=train,
                               calibrate=reproduce.CALIBRATIONS[("open", "estr")])  # fmt: skip
    assert status == "ran"
    calibration = json.loads((output_dir / reproduce.ESTR_CALIBRATION_FILE).read_text())
    # The calibrated τ masks DIS's step-0 fraction of the calibration batch, within one token.
    assert abs(calibration["estr_masked_fraction"] - calibration["dis_masked_fraction"]) <= 1 / calibration["action_tokens"]
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    assert saved["loss"]["name"] == "estr" and saved["loss"]["estr_tau"] == calibration["estr_tau"]
    assert saved["train"]["mode"] == "async" and saved["train"]["steps"] == 3
    assert reproduce.run_one(path, output_dir, 0, overrides, train_fn=train,
                             calibrate=reproduce.CALIBRATIONS[("open", "estr")]) == "skipped"  # fmt: skip
    report = reproduce.write_report("open", tmp_path).read_text()
    assert "| ESTR (τ calibrated) | `estr.yaml` | 1 |" in report and "τ =" in report


@pytest.mark.slow
@pytest.mark.parametrize(("suite", "row", "difficulty", "logged"), [
    ("chain", "sao", "[1,4]", ("critic/before_updates/explained_variance",)),
    ("repair", "frozen_unseen", "[1]", ("train/failed_test_share",)),
    ("critic", "running_mean_pool", "[1,4]", ("advantage/window_fill",)),
    ("online_hetero", "sao", "[1,4]", ("train/first_action_advantage/cute", "policy/kl_to_reference"))])  # fmt: skip
def test_quick_run_of_a_stress_suites_row_trains_and_reports(tmp_path, suite, row, difficulty, logged):
    """The chain suite's reference row, the repair suite's row whose test is unseen in SFT, the critic
    suite's running mean on the recurring pool, and the online_hetero suite's SAO row (first-action
    advantage by style; the KL penalty toward the warm start, as in the one-topic online suite, whose
    rows share its code path), end to end with the real trainer on tiny budgets: the suite's
    diagnostics in the metrics, the run in the report."""
    from sao_jax.train.loop import train

    path = reproduce.config_file(suite, row)
    tiny = [o for o in TINY if not o.startswith(("env.difficulty", "rollout.max_total_tokens"))]
    tiny += [f"env.difficulty={difficulty}"]
    overrides = [*reproduce.quick_overrides(load_config(path, tiny), reproduce.SUITES[suite]), *tiny]
    output_dir = reproduce.run_dir(tmp_path, suite, row, 0)
    assert reproduce.run_one(path, output_dir, 0, overrides, train_fn=train) == "ran"
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [line for line in lines if "train/reward_mean" in line]
    assert len(rl) == 3 and all(line["train/num_turns"] >= 1 for line in rl)
    assert all(any(key in line for line in rl) for key in logged), logged
    report = reproduce.write_report(suite, tmp_path).read_text()
    assert f"`{row}.yaml` | 1 |" in report


@pytest.mark.slow
def test_quick_run_of_the_offpolicy_suites_no_correction_row_lags_measures_the_mismatch_and_reports(tmp_path):
    """The off-policy suite's no-correction row end to end with the real trainer on tiny budgets: the
    lag clamped at the warm start (staleness 0, 1, 2 over 3 steps at L = 16), the mismatch measured on
    the lag-0 step, the diagnostics of the suite in the report."""
    from sao_jax.train.loop import train

    path = reproduce.config_file("offpolicy", "pg")
    tiny = [o for o in TINY if not o.startswith(("env.difficulty", "rollout.max_total_tokens"))]
    tiny += ["env.difficulty=[1,4]", "critic.warmup_steps=0"]
    overrides = [*reproduce.quick_overrides(load_config(path, tiny), reproduce.SUITES["offpolicy"]), *tiny]
    output_dir = reproduce.run_dir(tmp_path, "offpolicy", "pg", 0)
    assert reproduce.run_one(path, output_dir, 0, overrides, train_fn=train) == "ran"
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [line for line in lines if "train/reward_mean" in line]
    assert [line["async/staleness_mean"] for line in rl] == [0, 1, 2]
    assert rl[0]["mismatch/logprob_abs_mean"] < 1e-3 and rl[1]["mismatch/logprob_abs_mean"] is None
    assert all(line["policy/masked_fraction"] == 0 for line in rl)  # no correction masks nothing
    report = reproduce.write_report("offpolicy", tmp_path).read_text()
    assert "`pg.yaml` | 1 |" in report and "masked-token entropy" in report and "mismatch masked %" in report


def test_archived_runs_are_compressed_read_back_and_skipped_by_a_later_suite(tmp_path):
    success = reproduce.SUCCESS_KEY
    lines = [{"step": 0, success: 0.25}, {"step": 5, success: 0.75, "policy/advantage_mean": 0.1}]
    folder = reproduce.run_dir(tmp_path / "scratch", "table5", "token_level", 0)
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text("{}")
    config = to_dict(load_config(reproduce.config_file("table5", "token_level"), ["seed=0"]))
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "checkpoints").mkdir()
    unfinished = reproduce.run_dir(tmp_path / "scratch", "table5", "step_average", 0)
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")  # no summary.json: still running
    written = reproduce.archive_runs(tmp_path / "scratch", "table5", tmp_path / "kept")
    kept = reproduce.run_dir(tmp_path / "kept", "table5", "token_level", 0)
    assert written == [kept]
    first_bytes = (kept / "metrics.jsonl.gz").read_bytes()
    time.sleep(1.1)  # a gzip header's mtime has 1 s resolution
    reproduce.archive_runs(tmp_path / "scratch", "table5", tmp_path / "kept")
    assert (kept / "metrics.jsonl.gz").read_bytes() == first_bytes  # archived again: no change for git to see
    assert sorted(p.name for p in kept.iterdir()) == ["config.yaml", "metrics.jsonl.gz", "summary.json"]
    assert reproduce.load_runs(tmp_path / "kept", "table5", "token_level") == {0: lines}
    assert reproduce.run_one(reproduce.config_file("table5", "token_level"), kept, 0, [],
                             train_fn=lambda *a, **k: pytest.fail("a finished run is not run again")) == "skipped"
    # Archiving into the folder the suite ran in compresses the metrics beside the run, once.
    assert reproduce.archive_runs(tmp_path / "scratch", "table5", tmp_path / "scratch") == [folder]
    assert (folder / "metrics.jsonl.gz").exists() and (folder / "metrics.jsonl").exists()
    assert reproduce.archive_runs(tmp_path / "scratch", "table5", tmp_path / "scratch") == []
