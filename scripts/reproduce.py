"""Reproduce the paper's ablations: every config of a suite for N seeds, then a table and plots.

    python scripts/reproduce.py --suite table4 --seeds 3      # runs -> results/table4/<row>/seed<k>/
                                                              # report -> results/table4.md, results/table4/*.png
    python scripts/reproduce.py --suite all --quick           # smoke run, 1 seed, tiny budgets -> results/quick/
    python scripts/reproduce.py --suite open --report-only    # tables and plots from the metrics already there
    python scripts/reproduce.py --suite critic --seeds 10 --status   # which runs are done, started, not started
    python scripts/reproduce.py --suite table5 --seeds 3 train.steps=400   # key=value overrides for every run
    python scripts/reproduce.py --suite open --seeds 2 --rows dis estr     # only these rows
    python scripts/reproduce.py --suite chain --seeds 10 --out /scratch --archive results
        # runs in /scratch; the finished ones kept in results/chain/<row>/seed<k>/ (metrics.jsonl.gz,
        # summary.json, config.yaml: small enough to commit), the report written from there; with
        # --archive equal to --out, metrics.jsonl.gz is written beside each finished run

Suites (one YAML per row under configs/ablations/<suite>/): table4 (SAO's Table 4 + GRPO+DIS), table5
(step- vs token-level GAE), chain (Table 4's rows and step-average GAE on the chained calculator, whose
episodes hold 1-4 tool calls; pre-registered in results/DESIGN.md), online (style switches, SAO vs a
global running mean), online_hetero (the same over 12 topics of unequal difficulty, where the value
of a start state depends on the prompt: SAO vs global running means of one batch and of 128), open
(skip- vs cross-observation GAE on the guessing game; DIS vs ESTR at a matched step-0 masked
fraction), repair (skip- vs cross-observation GAE, and frozen vs trained critic
attention, on the chain task whose wrong answer gets a failed test and one repair), offpolicy (on the
chain task with sync mode's deterministic policy lag L: DIS vs no correction, PPO-clip against the
rollout, IcePop and ESTR, and DIS at L = 0).

Runs: seed k = 0..N−1, output_dir = OUT/<suite>/<row>/seed<k>. Resumable: a run whose summary.json
exists is skipped, a run whose folder holds its config.yaml but no summary is resumed
(`train(config, resume=True)` continues from its newest checkpoint, or starts over if it has none).
A folder whose config.yaml differs from the config it would run now is an error, not a silent mix of
two settings. Each run calls `sao_jax.train.loop.train` in this process (not a `sao-train`
subprocess): no interpreter and JAX start per run, one persistent XLA compilation cache for the
whole suite, and the runner is testable with a stub in place of `train`. A run that raises is
reported and the suite goes on (rerun the command to resume it). SIGTERM or Ctrl-C stops the run in
hand after its step, saved, and then the suite, exiting 143 or 130; rerunning the command resumes.
`--status` prints which runs are done, started (RL steps logged) or not started.

Report (from metrics.jsonl files alone): per row, over seeds, mean ± 95 % CI
(t-distribution, n−1 degrees of freedom) of the final held-out success (the last `eval/success_rate`),
its maximum, and the area under the held-out success curve normalised by the steps it spans
(= the time-average success, ours); the paper's numbers beside them, and whether the row's direction
against the reference row (SAO's design) agrees with the paper's; the paired difference to the
reference row with its 95 % interval, and whether the interval excludes 0 at 95 % and at 99 %. Per
seed: held-out success at the first and last evaluation, and the AUC. Mechanism diagnostics, from
whichever keys the runs log (mean ± 95 % CI over seeds of one statistic per run): the critic's
explained variance before its updates (the run's median after the critic warmup) and at the end of
value pretraining, the critic's attention and expert gradient norms, the masked fraction, the
advantage mean, and at the last evaluation the estimator share and the success per difficulty level.
Plots: held-out success vs step with 95 % CI bands; gradient norms per module group (critic and
policy) per step, log scale; online: per-step share of each style with the switches marked, and steps
to realign; online_hetero also: held-out success per phase and per difficulty level, the critic's
explained variance around the switches, and the first-action advantage of the old, new and other
style around the switches (table and plot); open (b): masked fraction and masked-token entropy per
step, DIS vs ESTR.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import math
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs" / "ablations"
SUCCESS_KEY = "eval/success_rate"
# Online experiment: the trainer logs, per RL step, the rewarded style and the share of the step's
# trajectories whose text reads as each style (`sao_jax.envs.judges.style_of`).
TARGET_STYLE_KEY = "train/target_style"
STYLE_SHARE_PREFIX = "train/style_share/"
ESTR_CALIBRATION_FILE = "estr_calibration.json"
# Mechanism diagnostics (`sao_jax.diagnostics`, `sao_jax.train`): the critic's fit to its targets on a
# step's fresh batch before its updates; the warm-start stage that pretrains the critic on the starting
# policy's rollouts (`warm_start.py`, lines at step 0 with `"stage": "value_pretrain"`, one per epoch);
# gradient norms per module group, `critic/grad_norm/<group>` and `policy/grad_norm/<group>`.
EV_BEFORE_KEY = "critic/before_updates/explained_variance"
EV_KEY = "critic/explained_variance"
VALUE_PRETRAIN_STAGE = "value_pretrain"
CRITIC_WARMUP_KEY = "train/critic_warmup"
GRAD_NORM_GROUPS = ("attention", "experts", "router", "value_head", "dense_mlp", "embeddings_norms")
LEVEL_PREFIX = SUCCESS_KEY + "/level_"  # held-out success per difficulty level (`difficulty_metrics`)
# Online experiment over topics (`topic_style_shift`): the share of texts meeting the quality check per
# level (`quality_metrics`), and per RL step the mean advantage on the first action token (the style
# choice) of the trajectories that wrote each style (`style_advantage_metrics`).
QUALITY_LEVEL_PREFIX = "eval/quality_rate/level_"
FIRST_ACTION_ADVANTAGE_PREFIX = "train/first_action_advantage/"
SWITCH_WINDOW = 5  # steps before / from a switch over which the critic's explained variance is averaged
ADVANTAGE_WINDOW = 10  # steps before / from a switch over which the first-action advantage is averaged


# ----------------------------------------------------------------------------------- the suites


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # configs/ablations/<suite>/<name>.yaml and the run folder
    label: str
    paper: tuple[float | None, ...] = ()  # one per Comparison.paper_columns; None = not reported


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Rows weighed against one reference row (SAO's design), in one table and one plot."""

    slug: str  # its plot: OUT/<suite>/<slug>.png
    title: str
    reference: str
    rows: tuple[Row, ...]
    paper_columns: tuple[str, ...] = ()
    per_step: tuple[tuple[str, str], ...] = ()  # extra per-step curves: (metric key, label)
    styles: bool = False  # the online experiment's style shares and realignment
    # The online experiment's tables per phase and around switches (held-out success per phase and per
    # level, critic EV around switches, first-action advantage by style) and its aligned plot.
    switches: bool = False
    pretraining_curve: bool = False  # value-pretraining corpus size → critic EV → success, one point per row
    # Extra diagnostic columns, each the mean over RL steps of one metric: (key, header, definition, scale).
    rl_means: tuple[tuple[str, str, str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Interaction:
    """(a − b) − (c − d) of final success, paired by seed: how much a difference between two rows
    (a − b) changes between two settings (c − d: the same rows in the other setting)."""

    title: str
    a: str
    b: str
    c: str
    d: str


@dataclasses.dataclass(frozen=True)
class Suite:
    comparisons: tuple[Comparison, ...]
    quick_overrides: tuple[str, ...] = ()  # added under --quick, after the budget caps
    interactions: tuple[Interaction, ...] = ()

    @property
    def rows(self) -> tuple[Row, ...]:
        """Every row once (a row may be in several comparisons; it runs once)."""
        return tuple({row.name: row for c in self.comparisons for row in c.rows}.values())


# The repair suite's skip/cross comparisons plot the critic's fit beside the two outcomes of a test.
REPAIR_OBSERVATION_CURVES = (("critic/before_updates/explained_variance", "critic explained variance before updates"),
                             ("eval/failed_test_share", "held-out share failing the first test"),
                             ("eval/repaired_share", "held-out share repaired"))
# The off-policy suite's columns besides the masked fraction: what the keep rule drops, and the drift.
OFF_POLICY_MEANS = (
    ("policy/masked_entropy_mean", "masked-token entropy", "the mean over RL steps of the mean rollout entropy H of "
     "the masked action tokens (0 on a step that masks none)", 1.0),
    ("async/staleness_mean", "staleness", "the mean over RL steps of the trajectories' mean staleness (versions "
     "between the trainer's policy and the one that sampled)", 1.0),
    ("mismatch/logprob_abs_mean", "mismatch |log μ − log π_θ|", "the mean over the RL steps with lag-0 tokens of "
     "the mean over them of |log μ − log π_θ| before the update: the training-inference mismatch alone", 1.0),
    ("mismatch/masked_fraction", "mismatch masked %", "the mean over the same steps of the share of lag-0 action "
     "tokens the loss masks", 100.0),
)  # fmt: skip
SUITES: dict[str, Suite] = {
    "table4": Suite((Comparison(
        "success", "Table 4: single-rollout design ablations (+ GRPO+DIS)", "sao",
        (Row("sao", "SAO", (97.3, 74.8, 29.8)),
         Row("no_faster_value", "w/o faster value", (95.0, 69.8, None)),
         Row("no_frozen_attention", "w/o frozen attention", (90.6, 74.5, None)),
         Row("vanilla_vapo", "Vanilla VAPO (no DIS)", (91.3, 69.0, None)),
         Row("running_mean", "Running-mean baseline", (79.8, 55.3, None)),
         Row("grpo_dis", "GRPO+DIS (group of 8)", (None, None, 27.0))),
        paper_columns=("AIME2025", "BeyondAIME", "SWE-Bench Verified"),
    ),)),
    "table5": Suite((Comparison(
        "success", "Table 5: step- vs token-level GAE", "token_level",
        (Row("token_level", "token-level (skip-observation)", (89.8,)),
         Row("step_average", "step-average", (85.8,)),
         Row("step_last_token", "step-last-token", (87.3,))),
        paper_columns=("AIME2025 @ 400 steps",),
    ),)),
    "chain": Suite((Comparison(
        "success", "Chain suite: Table 4's rows and the GAE granularity row on the chained calculator", "sao",
        (Row("sao", "SAO (token-level GAE)", (97.3, 74.8, 29.8, 89.8)),
         Row("no_faster_value", "w/o faster value", (95.0, 69.8, None, None)),
         Row("no_frozen_attention", "w/o frozen attention", (90.6, 74.5, None, None)),
         Row("running_mean", "Running-mean baseline", (79.8, 55.3, None, None)),
         Row("grpo_dis", "GRPO+DIS (group of 8)", (None, None, 27.0, None)),
         Row("step_average", "step-average GAE", (None, None, None, 85.8))),
        paper_columns=("AIME2025", "BeyondAIME", "SWE-Bench Verified", "AIME2025 @ 400 steps (Table 5)"),
        per_step=(("critic/before_updates/explained_variance", "critic explained variance before updates"),
                  ("policy/masked_fraction", "DIS masked fraction"),
                  ("eval/tool_share/est", "held-out share calling the estimator")),
    ),)),
    "online": Suite((Comparison(
        "success", "Online style shift: SAO vs running-mean baseline (global window 128)", "sao",
        (Row("sao", "SAO"), Row("running_mean", "running mean (global, 128)")), styles=True,
        per_step=(("critic/before_updates/explained_variance", "critic explained variance before updates"),
                  ("policy/advantage_first_action_token", "advantage at the first action token (the style choice)"),
                  ("policy/kl_to_reference", "KL to the warm start")),
    ),), quick_overrides=("env.options.switches=[[0, cute], [2, chuunibyou], [4, classical]]",)),
    "online_hetero": Suite((Comparison(
        "success", "Online style shift over topics of unequal difficulty: SAO vs running-mean baselines", "sao",
        (Row("sao", "SAO"), Row("running_mean_batch", "running mean (global, one batch = 32)"),
         Row("running_mean_128", "running mean (global, 128)")), styles=True, switches=True,
        per_step=(("critic/before_updates/explained_variance", "critic explained variance before updates"),
                  ("policy/advantage_first_action_token", "advantage at the first action token (the style choice)"),
                  ("train/quality_rate", "share of texts meeting the quality check"),
                  ("policy/kl_to_reference", "KL to the warm start")),
    ),), quick_overrides=("env.options.switches=[[0, cute], [2, chuunibyou], [4, classical]]",)),
    "open": Suite((
        Comparison("observation", "Open (a): skip- vs cross-observation GAE, guessing game, same critic",
                   "skip_observation", (Row("skip_observation", "skip-observation GAE"),
                                        Row("cross_observation", "cross-observation GAE"))),
        Comparison("keep_rule", "Open (b): DIS vs ESTR keep rule, matched step-0 masked fraction, async", "dis",
                   (Row("dis", "DIS"), Row("estr", "ESTR (τ calibrated)")),
                   per_step=(("policy/masked_fraction", "masked fraction"),
                             ("policy/masked_entropy_mean", "masked-token entropy"))),
    )),
    "repair": Suite((
        Comparison("observation", "Repair task: skip- vs cross-observation GAE, a failed test and one repair",
                   "skip_observation", (Row("skip_observation", "skip-observation GAE"),
                                        Row("cross_observation", "cross-observation GAE")),
                   per_step=REPAIR_OBSERVATION_CURVES),
        Comparison("observation_trained_critic",
                   "Repair task, amended: skip- vs cross-observation GAE, critic attention trained",
                   "skip_trained_attention", (Row("skip_trained_attention", "skip-observation GAE"),
                                              Row("cross_trained_attention", "cross-observation GAE")),
                   per_step=REPAIR_OBSERVATION_CURVES),
        Comparison("unseen", "Repair task: frozen vs trained critic attention, the test never in SFT", "frozen_unseen",
                   (Row("frozen_unseen", "frozen attention"), Row("trained_unseen", "trained attention")),
                   per_step=(("critic/before_updates/explained_variance", "critic explained variance before updates"),
                             ("critic/grad_norm/attention", "critic attention gradient norm"))),
    )),
    "offpolicy": Suite((Comparison(
        "success", "Off-policy drift: sync mode's policy lag L on the chain task, DIS vs no correction vs "
        "PPO-clip vs IcePop vs ESTR", "dis",
        (Row("dis", "DIS (SAO), lag L", (97.3, 74.8)),
         Row("pg", "no correction (policy gradient), lag L", (91.3, 69.0)),
         Row("ppo_clip", "PPO-clip against the rollout, lag L"),
         Row("icepop", "IcePop, lag L"),
         Row("estr", "ESTR, lag L"),
         Row("dis_no_lag", "DIS at L = 0")),
        paper_columns=("AIME2025 (Table 4: SAO vs vanilla VAPO, no DIS)", "BeyondAIME"),
        per_step=(("policy/masked_fraction", "masked fraction"),
                  ("policy/masked_entropy_mean", "masked-token entropy"),
                  ("policy/rollout_log_ratio_mean", "mean log π_θ − log μ over action tokens"),
                  ("mismatch/logprob_abs_mean", "|log μ − log π_θ| on lag-0 tokens (the mismatch)")),
        rl_means=OFF_POLICY_MEANS,
    ),)),
}
# The critic suite (results/DESIGN.md, "Critic suite"): SAO with a well-trained critic against the
# per-prompt running mean where its window fills (a pool of 200 prompts, each drawn ~16 times in 3,200
# trajectories) and where it mostly does not (4,096), and the value-pretraining corpus size.
CRITIC_CURVES = (("critic/before_updates/explained_variance", "critic explained variance before updates"),
                 ("advantage/window_fill", "running-mean window fill (earlier rewards)"),
                 ("probe/advantage_correlation", "advantage vs Monte-Carlo Q − V, correlation"))
SUITES["critic"] = Suite((
    Comparison("pool_small", "Critic suite, recurring pool (200 prompts): SAO vs the per-prompt running mean",
               "sao_pool", (Row("sao_pool", "SAO"), Row("running_mean_pool", "running mean (per prompt, 8)")),
               per_step=CRITIC_CURVES),
    Comparison("pool_large", "Critic suite, 4,096-prompt pool: SAO vs the per-prompt running mean and GRPO+DIS",
               "sao", (Row("sao", "SAO"), Row("running_mean", "running mean (per prompt, 8)"),
                       Row("grpo_dis", "GRPO+DIS (group of 8)")), per_step=CRITIC_CURVES),
    Comparison("pretraining", "Critic suite, scaled value pretraining: the corpus size", "sao",
               (Row("sao", "SAO"), Row("sao_pretrain1024", "1,024 pretraining rollouts"),
                Row("sao_pretrain256", "256 pretraining rollouts"), Row("sao_pretrain0", "no value pretraining")),
               per_step=CRITIC_CURVES[:1], pretraining_curve=True),
), interactions=(Interaction("(SAO − running mean) on the recurring pool − (SAO − running mean) on the 4,096 pool",
                             "sao_pool", "running_mean_pool", "sao", "running_mean"),))
# --quick: each budget is capped (min(config value, cap), so a 0 in a config — a critic-free row's
# value pretraining — stays 0). Eight trajectories a step still hold one GRPO group of 8.
QUICK_CAPS: dict[str, int] = {
    "sft.steps": 20, "sft.batch_size": 8, "critic.pretrain_rollouts": 16, "critic.pretrain_epochs": 1,
    "critic.warmup_steps": 1, "train.steps": 6, "train.batch_size": 8, "train.eval_every": 3,
    "train.checkpoint_every": 3, "env.train_prompts": 64, "env.rl_prompts": 16, "env.eval_prompts": 16,
    "rollout.num_slots": 8,
}  # fmt: skip


# ------------------------------------------------------------------------------------- running


def config_file(suite: str, row: str) -> Path:
    return CONFIG_DIR / suite / f"{row}.yaml"


def run_dir(out: Path, suite: str, row: str, seed: int) -> Path:
    return Path(out) / suite / row / f"seed{seed}"


def run_progress(output_dir: Path) -> str:
    """Where one run stands: "done" (its summary.json exists), "k/N" (started: k of its N =
    `train.steps` RL steps logged, 0 while in its warm start) or "·" (no folder of it)."""
    if (output_dir / "summary.json").exists():
        return "done"
    saved = output_dir / "config.yaml"
    if not saved.exists():
        return "·"
    steps = yaml.safe_load(saved.read_text())["train"]["steps"]
    metrics = output_dir / "metrics.jsonl"
    lines = [json.loads(text) for text in metrics.read_text().splitlines() if text.endswith("}")] if metrics.exists() else []
    logged = max((line["step"] for line in lines if "stage" not in line and "policy/loss" in line), default=0)
    return f"{logged}/{steps}"


def suite_status(suite_name: str, seeds: int, out: Path) -> str:
    """A Markdown table of the suite's rows × seeds 0..seeds−1 under `out` (`run_progress` of each), and
    how many runs are done, started and not started."""
    progress = {(row.name, seed): run_progress(run_dir(out, suite_name, row.name, seed))
                for row in SUITES[suite_name].rows for seed in range(seeds)}  # fmt: skip
    lines = [f"| row | {' | '.join(f'seed {k}' for k in range(seeds))} |", f"|---|{'---|' * seeds}"]
    for row in SUITES[suite_name].rows:
        lines.append(f"| {row.name} | {' | '.join(progress[row.name, k] for k in range(seeds))} |")
    done = sum(p == "done" for p in progress.values())
    started = sum(p not in ("done", "·") for p in progress.values())
    lines.append(f"\n{suite_name} under {out}: {done} of {len(progress)} runs done, {started} started, "
                 f"{len(progress) - done - started} not started")
    return "\n".join(lines)


def quick_overrides(config: Any, suite: Suite) -> list[str]:
    """The --quick budget caps for `config`, then the suite's own quick settings."""
    caps = []
    for key, cap in QUICK_CAPS.items():
        value = functools.reduce(getattr, key.split("."), config)
        caps.append(f"{key}={min(value, cap)}")
    return [*caps, *suite.quick_overrides]


def estr_tau_override(config: Any, output_dir: Path) -> list[str]:
    """`loss.estr_tau=τ` with τ calibrated at step 0 (`calibrate_estr_at_start`), cached per run."""
    cache = output_dir / ESTR_CALIBRATION_FILE
    if cache.exists():
        calibration = json.loads(cache.read_text())
    else:
        calibration = calibrate_estr_at_start(config)
        output_dir.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(calibration, indent=2))
    return [f"loss.estr_tau={calibration['estr_tau']!r}"]


# Rows whose config needs a value measured at run time: (suite, row) -> (config, output_dir) -> overrides.
CALIBRATIONS: dict[tuple[str, str], Callable[[Any, Path], list[str]]] = {("open", "estr"): estr_tau_override}


def calibrate_estr_at_start(config: Any) -> dict[str, float]:
    """ESTR's τ such that ESTR and DIS mask the same fraction of action tokens at step 0.

    The starting policy (this seed's SFT, exactly as `train` makes it) rolls out the prompts of RL
    step 1 with the rollout sampling settings; the trainer's forward gives log π_θ. With
    q = the fraction of action tokens DIS masks (`dis_mask`, the config's ε_low/ε_high), τ is
    `calibrate_estr_tau(..., target_masked_fraction=q)`: the (1−q) quantile of δ²/(H + ε).
    When q = 0 (no train/inference mismatch) every τ above the largest score matches; this returns
    2 × the largest score, the rule of `calibrate_estr_tau` for an empty masked set.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sao_jax import losses
    from sao_jax.metrics import MetricsWriter
    from sao_jax.rollout.trajectory import collate
    from sao_jax.train import batches, build, warm_start
    from sao_jax.train import steps as steps_lib

    run = build.build_run(config)
    graph, _, buffers = steps_lib.split_model(run.policy)
    with tempfile.TemporaryDirectory() as scratch, MetricsWriter(scratch, tensorboard=False) as writer:
        params = warm_start.run_sft(run, writer)
    weights = nnx.state(nnx.merge(graph, params, buffers))
    trajectories, _ = batches.LockstepBatches(run, run.agent_loop(greedy=False)).next(1, weights)
    batch = collate(trajectories, batch_size=config.train.batch_size, buckets=run.buckets)
    logits, _ = jax.jit(steps_lib.policy_logits, static_argnums=0)(graph, params, buffers, batch)
    logp = losses.token_logprobs(logits, batch.tokens)
    action = jnp.asarray(batch.action_mask, bool)
    cfg = config.loss
    dis_keep = losses.dis_mask(logp, batch.rollout_logprobs, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    dis_masked = float(jnp.sum(action & ~dis_keep) / jnp.sum(action))
    tau = float(losses.calibrate_estr_tau(logp, batch.rollout_logprobs, batch.rollout_entropy, action,
                                          target_masked_fraction=dis_masked, eps=cfg.estr_eps))  # fmt: skip
    estr_keep = losses.estr_mask(logp, batch.rollout_logprobs, batch.rollout_entropy, tau=tau, eps=cfg.estr_eps)
    return {
        "estr_tau": tau,
        "dis_masked_fraction": dis_masked,
        "estr_masked_fraction": float(jnp.sum(action & ~estr_keep) / jnp.sum(action)),
        "action_tokens": int(jnp.sum(action)),
        "max_abs_log_ratio": float(jnp.max(jnp.where(action, jnp.abs(logp - batch.rollout_logprobs), 0.0))),
    }


def _plain(tree: Any) -> Any:
    """A config dict as YAML reads it back (tuples become lists)."""
    return json.loads(json.dumps(tree))


def _differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            keys += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            keys.append(f"{prefix}{key}")
    return keys


def run_one(path: Path, output_dir: Path, seed: int, overrides: Sequence[str], *, train_fn: Callable,
            calibrate: Callable[[Any, Path], list[str]] | None = None) -> str:  # fmt: skip
    """Run (or skip, or resume) one config; returns "skipped", "resumed" or "ran"."""
    from sao_jax.config import load_config, to_dict

    # Runs of one seed share their warm start (`sft.cache_dir`): it is trained once, in OUT/sft_cache.
    cache = output_dir.parents[2] / "sft_cache"
    placement = [f"seed={seed}", f"output_dir={output_dir}", f"sft.cache_dir={cache}"]
    config = load_config(path, [*overrides, *placement])
    if calibrate is not None:
        config = load_config(path, [*overrides, *calibrate(config, output_dir), *placement])
    saved = output_dir / "config.yaml"  # `train` writes it first: the folder holds a (maybe partial) run
    if saved.exists():
        changed = [k for k in _differences(yaml.safe_load(saved.read_text()), _plain(to_dict(config)))
                   if k not in ("output_dir", "sft.cache_dir")]  # the same folder, however --out was spelled
        if changed:
            raise RuntimeError(f"{output_dir} holds a run of a different config (differs in {', '.join(changed)}); "
                               "remove the folder or pick another --out")  # fmt: skip
    if (output_dir / "summary.json").exists():
        return "skipped"
    resumed = saved.exists()
    train_fn(config, resume=resumed)
    return "resumed" if resumed else "ran"


def run_suite(suite_name: str, seeds: int, out: Path, *, overrides: Sequence[str] = (), quick: bool = False,
              train_fn: Callable | None = None, log: Callable[[str], None] = print,
              rows: Sequence[str] | None = None) -> dict[str, list[str]]:  # fmt: skip
    """Every row x seed of a suite (only `rows`, if given); returns {"skipped"|"resumed"|"ran"|"failed":
    [run folders]}. A run that raises is reported and the suite goes on; a run stopped by SIGTERM or
    SIGINT (`Interrupted`: its step in hand saved) stops the suite: the exception propagates."""
    from sao_jax.config import load_config
    from sao_jax.train.signals import Interrupted

    if train_fn is None:
        from sao_jax.train.loop import train as train_fn
    suite = SUITES[suite_name]
    names = [row.name for row in suite.rows]
    unknown = sorted(set(rows or ()) - set(names))
    if unknown:
        raise ValueError(f"suite {suite_name} has no row(s) {unknown}; its rows are {names}")
    outcome: dict[str, list[str]] = {"skipped": [], "resumed": [], "ran": [], "failed": []}
    for row in suite.rows:
        if rows and row.name not in rows:
            continue
        path = config_file(suite_name, row.name)
        for seed in range(seeds):
            output_dir = run_dir(out, suite_name, row.name, seed)
            try:
                extra = quick_overrides(load_config(path, overrides), suite) if quick else []
                status = run_one(path, output_dir, seed, [*extra, *overrides], train_fn=train_fn,
                                 calibrate=CALIBRATIONS.get((suite_name, row.name)))
            except Interrupted:  # the signal was meant for the suite, not only for its run in hand
                log(f"stopped  {output_dir}")
                raise
            except Exception:  # noqa: BLE001 — one broken row must not stop the others; it is reported
                log(f"FAILED {output_dir}:\n{traceback.format_exc()}")
                status = "failed"
            log(f"{status:8s} {output_dir}")
            outcome[status].append(str(output_dir))
    return outcome


# ------------------------------------------------------------------------------------ statistics

# Two-sided 95 % critical values t_{0.975, df} of Student's t (standard tables); a df between entries
# uses the next smaller tabled df, which is conservative (a wider interval).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
         18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
         26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip


# Two-sided 99 % critical values t_{0.995, df}, the same tabled dfs and the same rounding down.
T_995 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355, 9: 3.250,
         10: 3.169, 11: 3.106, 12: 3.055, 13: 3.012, 14: 2.977, 15: 2.947, 16: 2.921, 17: 2.898,
         18: 2.878, 19: 2.861, 20: 2.845, 21: 2.831, 22: 2.819, 23: 2.807, 24: 2.797, 25: 2.787,
         26: 2.779, 27: 2.771, 28: 2.763, 29: 2.756, 30: 2.750, 40: 2.704, 60: 2.660, 120: 2.617}  # fmt: skip
T_TABLES = {0.95: T_975, 0.99: T_995}


def t_critical(df: int, level: float = 0.95) -> float:
    """t_{(1+level)/2, df} for a two-sided interval at `level` (0.95 or 0.99), from the tables above."""
    if df < 1:
        raise ValueError(f"t_critical: degrees of freedom must be >= 1 (got {df})")
    table = T_TABLES[level]
    return table[max(k for k in table if k <= df)]


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of the t-interval at `level`: x̄ ± t_{(1+level)/2, n−1} · s/√n, s the sample
    standard deviation (n−1 in the denominator). Half-width NaN for a single value."""
    x = np.asarray(values, float)
    if x.size == 0:
        raise ValueError("mean_ci: no values")
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), t_critical(x.size - 1, level) * float(x.std(ddof=1)) / math.sqrt(x.size)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """`mean_ci` at 95 %: x̄ ± t_{0.975, n−1} · s/√n."""
    return mean_ci(values, 0.95)


def excludes_zero(values: Sequence[float], level: float) -> bool | None:
    """Whether the t-interval at `level` of the values' mean lies strictly on one side of 0
    (|x̄| > half-width); None for fewer than two values (no interval)."""
    if len(values) < 2:
        return None
    mean, half = mean_ci(values, level)
    return abs(mean) > half


def eval_curve(lines: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, held-out success) of a run's evaluation lines, by step."""
    points = sorted((line["step"], line[SUCCESS_KEY]) for line in lines if line.get(SUCCESS_KEY) is not None)
    steps, success = zip(*points) if points else ((), ())
    return np.asarray(steps, float), np.asarray(success, float)


def run_scores(lines: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Final and max held-out success, and the area under the success curve / the steps it spans
    (trapezoid rule; a single evaluation is its own average)."""
    steps, success = eval_curve(lines)
    if not len(steps):
        raise ValueError(f"no {SUCCESS_KEY} line in the metrics")
    span = steps[-1] - steps[0]
    auc = float(np.sum((success[1:] + success[:-1]) / 2 * np.diff(steps)) / span) if span > 0 else float(success[0])
    return {"final": float(success[-1]), "max": float(success.max()), "auc": auc}


def per_step(runs: Sequence[Sequence[Mapping[str, Any]]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, 95 % half-width) of `key` over runs, at the steps every run logged it (the last
    line of a step wins)."""
    by_run = [{line["step"]: line[key] for line in lines if line.get(key) is not None} for lines in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_run))) if by_run else []
    stats = [mean_ci95([d[s] for d in by_run]) for s in steps]
    mean, half = (np.asarray(v, float) for v in zip(*stats)) if stats else (np.zeros(0), np.zeros(0))
    return np.asarray(steps, float), mean, half


def rl_lines(lines: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The lines of RL steps: a numeric `step` ≥ 1 and no `stage` key. The warm-start stages (SFT,
    value pretraining) write theirs at step 0 with a `stage`; the evaluation before RL is step 0."""
    return [line for line in lines if "stage" not in line and isinstance(line.get("step"), (int, float))
            and line["step"] >= 1]  # fmt: skip


def critic_warmup_steps(lines: Sequence[Mapping[str, Any]], config: Mapping[str, Any] | None = None) -> int:
    """How many of the run's first RL steps were critic-only warmup. A run whose RL lines carry
    `train/critic_warmup` spent its warmup inside the RL budget: `critic.warmup_steps` of its
    config.yaml, or without one the last RL step flagged. A run without that key ran its warmup
    before RL step 1 (lines at step 0, `"stage": "critic_warmup"`): 0."""
    if not any(CRITIC_WARMUP_KEY in line for line in rl_lines(lines)):
        return 0
    if config is not None and (config.get("critic") or {}).get("warmup_steps") is not None:
        return int(config["critic"]["warmup_steps"])
    return int(max((line["step"] for line in rl_lines(lines) if line.get(CRITIC_WARMUP_KEY)), default=0))


def median_after_warmup(lines: Sequence[Mapping[str, Any]], key: str, warmup_steps: int) -> float | None:
    """Median of `key` over the RL steps after the critic warmup (step > `warmup_steps`) that log it;
    None if none does."""
    values = [line[key] for line in rl_lines(lines) if line["step"] > warmup_steps and line.get(key) is not None]
    return float(np.median(values)) if values else None


def rl_mean(lines: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of `key` over the RL steps that log it (critic warmup steps included); None if none does."""
    values = [line[key] for line in rl_lines(lines) if line.get(key) is not None]
    return float(np.mean(values)) if values else None


def last_steps_mean(lines: Sequence[Mapping[str, Any]], key: str, steps: int) -> float | None:
    """Mean of `key` over the run's last `steps` RL steps that log it; None if none does."""
    values = [line[key] for line in rl_lines(lines) if line.get(key) is not None][-steps:]
    return float(np.mean(values)) if values else None


def first_steps_mean(lines: Sequence[Mapping[str, Any]], key: str, steps: int) -> float | None:
    """Mean of `key` over the run's first `steps` RL steps that log it; None if none does."""
    values = [line[key] for line in rl_lines(lines) if line.get(key) is not None][:steps]
    return float(np.mean(values)) if values else None


def last_stage_value(lines: Sequence[Mapping[str, Any]], stage: str, key: str) -> float | None:
    """`key` on the last line of warm-start `stage` (e.g. the last value-pretraining epoch's critic
    explained variance); None if there is no such line or it lacks `key`."""
    last = next((line for line in reversed(lines) if line.get("stage") == stage), {})
    return float(last[key]) if last.get(key) is not None else None


def at_last_eval(lines: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """`key` on the line of the last evaluation (the highest step logging `eval/success_rate`, the last
    such line of that step); None if that line lacks it."""
    evals = [line for line in lines if line.get(SUCCESS_KEY) is not None]
    if not evals:
        return None
    last = max(line["step"] for line in evals)
    value = [line for line in evals if line["step"] == last][-1].get(key)
    return None if value is None else float(value)


def realignment(lines: Sequence[Mapping[str, Any]], *, hold: int = 5, threshold: float = 0.5) -> list[dict[str, Any]]:
    """Steps to realign after each switch of the rewarded style (ours): after a switch at step s to
    style S, the first logged step t ≥ s from which S's share is ≥ `threshold` on `hold` consecutive
    logged steps (within the segment before the next switch); steps = t − s, None if never.
    `held_majority`: S already had ≥ `threshold` of the switch step's trajectories (sampled before
    any update on the new rewards), so the switch tests nothing: the policy had not left S.
    `window`: the steps from the switch to the next one (or to the last logged step, inclusive)."""
    logged = sorted((line["step"], line) for line in lines if line.get(TARGET_STYLE_KEY) is not None)
    steps = [s for s, _ in logged]
    targets = [line[TARGET_STYLE_KEY] for _, line in logged]
    starts = [i for i in range(1, len(targets)) if targets[i] != targets[i - 1]]
    out = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(logged)
        style = targets[start]
        ok = [(line.get(STYLE_SHARE_PREFIX + style) or 0.0) >= threshold for _, line in logged[start:end]]
        first = next((i for i in range(len(ok) - hold + 1) if all(ok[i:i + hold])), None)
        window = (steps[end] if end < len(logged) else steps[-1] + 1) - steps[start]
        out.append({"switch_step": steps[start], "style": style, "held_majority": bool(ok and ok[0]),
                    "steps": None if first is None else steps[start + first] - steps[start], "window": window})  # fmt: skip
    return out


# ------------------------------------------------------------------------------------- the report


def finished_runs(out: Path, suite: str, row: str) -> dict[int, Path]:
    """{seed: run folder} of the finished runs (summary.json and metrics.jsonl, or its archived
    metrics.jsonl.gz, written) of one row; empty when the row's folder is absent."""
    runs = {}
    for folder in sorted((Path(out) / suite / row).glob("seed*")):
        if (folder / "summary.json").exists() and any((folder / name).exists() for name in METRICS_FILES):
            runs[int(folder.name[len("seed"):])] = folder
    return runs


# A run's metrics as the trainer writes them, or as `--archive` keeps a finished run in the repository
# (compressed, with its summary.json and config.yaml; checkpoints, events and plots left out).
METRICS_FILES = ("metrics.jsonl", "metrics.jsonl.gz")


def read_run_metrics(folder: Path) -> list[dict[str, Any]]:
    """A run folder's metric lines, from metrics.jsonl or else metrics.jsonl.gz."""
    from sao_jax.metrics import read_metrics

    if (folder / "metrics.jsonl").exists():
        return read_metrics(folder / "metrics.jsonl")
    with gzip.open(folder / "metrics.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def without_impossible_fits(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`lines` less each explained variance below `diagnostics.EXPLAINED_VARIANCE_FLOOR`, the least
    `fit_metrics` can report. Runs logged before it treated targets that are constant up to rounding
    as constant hold some (−1e14 and below, from batches without reward); each would swamp a mean
    over seeds. The report reads these lines; the archive keeps the lines as logged."""
    from sao_jax.diagnostics import EXPLAINED_VARIANCE_FLOOR

    def possible(key: str, value: Any) -> bool:
        return not (key.endswith("explained_variance") and isinstance(value, (int, float))
                    and value < EXPLAINED_VARIANCE_FLOOR)  # fmt: skip

    return [{k: v for k, v in line.items() if possible(k, v)} for line in lines]


def archive_runs(out: Path, suite: str, archive: Path) -> list[Path]:
    """Copy each finished run of `suite` under `out` to the same place under `archive` as
    metrics.jsonl.gz, summary.json and config.yaml (what the report and a resumed suite read), so a
    suite's finished runs can be kept in the repository and a later `--seeds` run skips them."""
    written = []
    for row in SUITES[suite].rows:
        for seed, folder in finished_runs(out, suite, row.name).items():
            target = run_dir(archive, suite, row.name, seed)
            in_place = target.resolve() == folder.resolve()  # --out and --archive the same folder
            if in_place and (target / "metrics.jsonl.gz").exists():
                continue
            target.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(line) + "\n" for line in read_run_metrics(folder))
            # mtime 0 and no file name in the header: archiving the same run again writes the same bytes.
            with open(target / "metrics.jsonl.gz", "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:
                f.write(text.encode())
            if not in_place:
                for name in ("summary.json", "config.yaml"):
                    shutil.copyfile(folder / name, target / name)
            written.append(target)
    return written


def load_runs(out: Path, suite: str, row: str) -> dict[int, list[dict[str, Any]]]:
    """{seed: metrics lines} of the finished runs (summary.json written) of one row."""
    return {seed: without_impossible_fits(read_run_metrics(folder))
            for seed, folder in finished_runs(out, suite, row).items()}


def load_warmups(out: Path, suite: str, row: str, runs: Mapping[int, list]) -> dict[int, int]:
    """{seed: critic warmup steps} of one row's finished runs (`critic_warmup_steps`, from each run's
    config.yaml where it has one)."""
    warmups = {}
    for seed, folder in finished_runs(out, suite, row).items():
        path = folder / "config.yaml"
        config = yaml.safe_load(path.read_text()) if path.exists() else None
        warmups[seed] = critic_warmup_steps(runs.get(seed, []), config if isinstance(config, Mapping) else None)
    return warmups


def _fmt(mean: float, half: float, scale: float = 100.0) -> str:
    if math.isnan(half):
        return f"{scale * mean:.1f}"
    return f"{scale * mean:.1f} ± {scale * half:.1f}"


def _fmt_number(mean: float, half: float, spec: str) -> str:
    """mean ± half-width unscaled, in `spec` (the mean alone without an interval)."""
    return f"{mean:{spec}}" if math.isnan(half) else f"{mean:{spec}} ± {half:{spec}}"


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def paired_difference(row: Mapping[int, float], reference: Mapping[int, float]) -> tuple[float, float, int]:
    """Mean and 95 % half-width of row − reference over the seeds both ran (paired by seed: the runs of
    a seed share the warm start and the prompt stream), and how many seeds that is."""
    seeds = sorted(set(row) & set(reference))
    if not seeds:
        return math.nan, math.nan, 0
    mean, half = mean_ci95([row[s] - reference[s] for s in seeds])
    return mean, half, len(seeds)


def direction(comparison: Comparison, row: Row, ours: Mapping[str, Mapping[int, float]]) -> str:
    """Whether our final-success difference to the reference row (paired by seed) has the paper's sign."""
    reference = next(r for r in comparison.rows if r.name == comparison.reference)
    paper = {_sign(p - q) for p, q in zip(row.paper, reference.paper) if p is not None and q is not None}
    if not paper or row.name not in ours or reference.name not in ours:
        return "—"
    if len(paper) > 1:
        return "paper mixed"
    mean, half, n = paired_difference(ours[row.name], ours[reference.name])
    if n == 0:
        return "—"
    verdict = "tie" if _sign(mean) == 0 else "agrees" if _sign(mean) == paper.pop() else "disagrees"
    if n == 1:
        return f"{verdict} (1 seed)"
    return f"{verdict} (Δ CI includes 0)" if abs(mean) <= half else verdict


def robustness(row: Mapping[int, float], reference: Mapping[int, float], scale: float = 100.0) -> str:
    """Whether the paired difference row − reference (by shared seed) has a t-interval that excludes 0
    at 95 % and at 99 % ("yes / no"), and the 99 % half-width; "—" below two shared seeds."""
    differences = [row[s] - reference[s] for s in sorted(set(row) & set(reference))]
    if len(differences) < 2:
        return "—"
    at95, at99 = ("yes" if excludes_zero(differences, level) else "no" for level in (0.95, 0.99))
    return f"{at95} / {at99} (99 %: ± {scale * mean_ci(differences, 0.99)[1]:.1f})"


def comparison_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    finals = {name: {seed: run_scores(metrics)["final"] for seed, metrics in by_seed.items()}
              for name, by_seed in runs.items() if by_seed}  # fmt: skip
    reference_label = next(r.label for r in comparison.rows if r.name == comparison.reference)
    header = ["row", "config", "seeds", "final success %", "max success %", "AUC %",
              f"Δ final vs {reference_label} (paired)", "Δ excludes 0 at 95 % / 99 %",
              *(f"paper {c}" for c in comparison.paper_columns)]  # fmt: skip
    if comparison.paper_columns:
        header.append("direction vs paper")
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in comparison.rows:
        scores = [run_scores(metrics) for metrics in runs.get(row.name, {}).values()]
        cells = [row.label, f"`{row.name}.yaml`", str(len(scores))]
        if scores:
            cells += [_fmt(*mean_ci95([s[k] for s in scores])) for k in ("final", "max", "auc")]
            mean, half, n = paired_difference(finals[row.name], finals.get(comparison.reference, {}))
            cells.append("—" if row.name == comparison.reference or n == 0
                         else f"{100 * mean:+.1f}" + (" (1 seed)" if n == 1 else f" ± {100 * half:.1f}"))  # fmt: skip
            cells.append("—" if row.name == comparison.reference
                         else robustness(finals[row.name], finals.get(comparison.reference, {})))  # fmt: skip
        else:
            cells += ["not run"] * 3 + ["—", "—"]
        cells += ["—" if p is None else f"{p:.1f}" for p in row.paper]
        if comparison.paper_columns:
            cells.append("—" if row.name == comparison.reference else direction(comparison, row, finals))
        table.append("| " + " | ".join(cells) + " |")
    return table


def per_seed_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    """One line per row, one column per seed: held-out success at the first evaluation → the last, and
    the AUC (`run_scores`), in %."""
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    if not seeds:
        return []
    lines = ["Per seed: held-out success % at the first evaluation → at the last (start→end), and AUC %:", "",
             "| row | " + " | ".join(f"seed {k}" for k in seeds) + " |", "|" + "---|" * (len(seeds) + 1)]  # fmt: skip
    for row in comparison.rows:
        cells = [row.label]
        for seed in seeds:
            metrics = runs.get(row.name, {}).get(seed)
            if metrics is None:
                cells.append("—")
                continue
            _, success = eval_curve(metrics)
            cells.append(f"{100 * success[0]:.1f}→{100 * success[-1]:.1f} (AUC {100 * run_scores(metrics)['auc']:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@dataclasses.dataclass(frozen=True)
class Diagnostic:
    """A column of the diagnostics table: one statistic per run (None where the run does not log its
    key), shown as mean ± 95 % CI over the runs that have it."""

    header: str
    definition: str  # for the text above the table
    statistic: Callable[[Sequence[Mapping[str, Any]], int], float | None]  # (metrics lines, critic warmup steps)
    scale: float = 1.0
    spec: str = ".2f"
    exact_zero: bool = False  # a nonnegative statistic: "0 exactly" when it is 0 in every run


def diagnostic_columns(levels: Sequence[str] = (), rl_means: Sequence[tuple[str, str, str, float]] = ()
                       ) -> list[Diagnostic]:  # fmt: skip
    """The mechanism diagnostics, one column each; `levels`: the `eval/success_rate/level_<d>` keys;
    `rl_means`: a comparison's extra columns (`Comparison.rl_means`)."""
    columns = [
        Diagnostic("critic EV before updates", "the run's median, over the RL steps after the critic warmup "
                   "(`critic.warmup_steps`), of the critic's explained variance on the step's fresh batch before "
                   "its updates", lambda lines, warmup: median_after_warmup(lines, EV_BEFORE_KEY, warmup)),
        Diagnostic("critic EV, end of value pretraining", "the critic's explained variance over the last "
                   "epoch of value pretraining", lambda lines, _: last_stage_value(lines, VALUE_PRETRAIN_STAGE, EV_KEY)),
        Diagnostic("critic ‖∇‖ attention", "the mean over RL steps of the L2 norm of the critic's gradient in its "
                   "attention layers (0 when they are frozen)",
                   lambda lines, _: rl_mean(lines, "critic/grad_norm/attention"), spec=".3g", exact_zero=True),
        Diagnostic("critic ‖∇‖ experts", "the same in its routed and shared experts",
                   lambda lines, _: rl_mean(lines, "critic/grad_norm/experts"), spec=".3g", exact_zero=True),
        Diagnostic("masked fraction %", "the mean over RL steps of the share of action tokens the keep rule "
                   "(DIS, ESTR) masks", lambda lines, _: rl_mean(lines, "policy/masked_fraction"), scale=100.0,
                   exact_zero=True),
        Diagnostic("advantage mean", "the mean over RL steps of the advantage's mean over action tokens",
                   lambda lines, _: rl_mean(lines, "policy/advantage_mean"), spec=".3f"),
        Diagnostic("window fill", "the mean over RL steps of the number of earlier rewards in the running-mean "
                   "window each trajectory reads (`advantage/window_fill`; 0: no baseline)",
                   lambda lines, _: rl_mean(lines, "advantage/window_fill")),
        Diagnostic("empty windows %", "the mean over RL steps of the share of trajectories whose running-mean "
                   "window is empty (baseline 0)", lambda lines, _: rl_mean(lines, "advantage/window_empty"),
                   scale=100.0, spec=".1f", exact_zero=True),
        Diagnostic("probe correlation", "the mean over the run's advantage probes of the correlation between "
                   "the estimator's advantage at a decision and its Monte-Carlo Q − V (`train.probe_every`)",
                   lambda lines, _: rl_mean(lines, "probe/advantage_correlation")),
        Diagnostic("policy entropy (first 5 steps)", "the mean over the first 5 RL steps of the policy's entropy "
                   "(nats) on the tokens it kept, under the sampling distribution: the warm start's (near 0: "
                   "each prompt answered the same way every time)",
                   lambda lines, _: first_steps_mean(lines, "policy/kept_entropy_mean", 5), spec=".3f"),
        Diagnostic("train success % (last 25 steps)", "the mean success of the training rollouts over the "
                   "run's last 25 RL steps (beside the held-out success: a gap is memorisation of the pool)",
                   lambda lines, _: last_steps_mean(lines, "train/success_rate", 25), scale=100.0, spec=".1f"),
        Diagnostic("estimator share % (last eval)", "at the last evaluation, the share of answered held-out "
                   "episodes that called the estimator tool", lambda lines, _: at_last_eval(lines, "eval/tool_share/est"),
                   scale=100.0, spec=".1f"),
    ]  # fmt: skip
    for key, header, definition, scale in rl_means:
        columns.append(Diagnostic(header, definition, lambda lines, _, key=key: rl_mean(lines, key), scale=scale,
                                  spec=".3g" if scale == 1.0 else ".2f", exact_zero=True))  # fmt: skip
    for key in levels:
        level = key[len(LEVEL_PREFIX):]
        columns.append(Diagnostic(f"level {level} success % (last eval)", "", scale=100.0, spec=".1f",
                                  statistic=lambda lines, _, key=key: at_last_eval(lines, key)))  # fmt: skip
    return columns


def level_keys(runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    """The `eval/success_rate/level_<d>` keys any run logs, by level."""
    keys = {k for by_seed in runs.values() for lines in by_seed.values() for line in lines for k in line
            if k.startswith(LEVEL_PREFIX)}  # fmt: skip
    levels = {k: k[len(LEVEL_PREFIX):] for k in keys}
    return sorted(keys, key=lambda k: (0, int(levels[k]), "") if levels[k].isdigit() else (1, 0, levels[k]))


def diagnostic_cell(column: Diagnostic, runs: Sequence[tuple[Sequence[Mapping[str, Any]], int]]) -> str | None:
    """One row's cell: mean ± 95 % CI over its runs of `column.statistic`; "0 exactly" for an
    `exact_zero` statistic that is 0 in every run; "(k/n runs)" when only k of its n runs log it;
    None when no run does."""
    values = [v for v in (column.statistic(lines, warmup) for lines, warmup in runs) if v is not None]
    if not values:
        return None
    if column.exact_zero and all(v == 0 for v in values):
        text = "0 exactly"
    else:
        mean, half = (column.scale * v for v in mean_ci95(values))
        text = f"{mean:{column.spec}}" + ("" if math.isnan(half) else f" ± {half:{column.spec}}")
    return text + (f" ({len(values)}/{len(runs)} runs)" if len(values) < len(runs) else "")


def diagnostics_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]],
                      warmups: Mapping[str, Mapping[int, int]]) -> list[str]:  # fmt: skip
    """One line per row: each diagnostic of `diagnostic_columns` that some run logs ("—" for a row none
    of whose runs logs it); [] when no run logs any."""
    per_row = {row.name: [(lines, warmups.get(row.name, {}).get(seed, 0)) for seed, lines in
                          runs.get(row.name, {}).items()] for row in comparison.rows}  # fmt: skip
    shown = []  # (column, {row: cell}) of the columns some run logs
    for column in diagnostic_columns(level_keys(runs), comparison.rl_means):
        got = {name: diagnostic_cell(column, found) for name, found in per_row.items() if found}
        if any(c is not None for c in got.values()):
            shown.append((column, got))
    if not shown:
        return []
    defined = [f"- {c.header}: {c.definition}." for c, _ in shown if c.definition]
    if any(not c.definition for c, _ in shown):
        defined.append(f"- level d success: at the last evaluation, the held-out success of the prompts of "
                       f"difficulty level d (`{LEVEL_PREFIX}<d>`).")  # fmt: skip
    text = ["Mechanism diagnostics: mean ± 95 % CI over seeds of one statistic per run; \"0 exactly\": 0 in every "
            "run; \"—\": no run of the row logs it; \"(k/n runs)\": k of the row's n runs log it (an explained "
            "variance below −1 − 2·10⁶, less than `diagnostics.fit_metrics` can give, counts as not logged: runs "
            "made before its rule for targets constant up to rounding hold a few, from batches without reward).", "",
            "| row | runs | " + " | ".join(c.header for c, _ in shown) + " |", "|" + "---|" * (len(shown) + 2)]  # fmt: skip
    for row in comparison.rows:
        found = per_row[row.name]
        cells = [got.get(row.name) or "—" for _, got in shown] if found else ["not run"] * len(shown)
        text.append(f"| {row.label} | {len(found)} | " + " | ".join(cells) + " |")
    return [*text, "", *defined]


def realignment_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    per_row = {row.name: [realignment(lines) for lines in runs.get(row.name, {}).values()] for row in comparison.rows}
    switches = next((r for found in per_row.values() for r in found if r), [])
    if not switches:
        return [f"No `{TARGET_STYLE_KEY}` switches in the metrics: steps to realign cannot be measured."]
    header = ["row", *(f"→ {s['style']} at step {s['switch_step']}" for s in switches)]
    lines = ["Steps to realign (new style ≥ 50 % of a step's trajectories on 5 consecutive steps), "
             "mean ± 95 % CI over the seeds that realigned; a run whose policy already wrote the new style "
             "in ≥ 50 % of the switch step's trajectories is not counted (\"held it already\"):", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for row in comparison.rows:
        cells = [row.label]
        for k in range(len(switches)):
            tested = [found[k] for found in per_row[row.name] if len(found) > k]
            held = sum(f["held_majority"] for f in tested)
            got = [f["steps"] for f in tested if not f["held_majority"]]
            done = [g for g in got if g is not None]
            text = _fmt(*mean_ci95(done), scale=1.0) if done else "—"
            note = f"; {held} held it already" if held else ""
            cells.append(f"{text} ({len(done)}/{len(got)} realigned{note})" if tested else "not run")
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", *realigned_share_table(comparison, runs)]


def counted_switches(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's switches (`realignment`) to a style it had left: those not `held_majority`."""
    return [f for f in realignment(lines) if not f["held_majority"]]


def realigned_share(lines: Sequence[Mapping[str, Any]]) -> float | None:
    """The share of a run's counted switches after which it realigned; None without one."""
    found = counted_switches(lines)
    return sum(f["steps"] is not None for f in found) / len(found) if found else None


def realign_steps(lines: Sequence[Mapping[str, Any]]) -> float | None:
    """A run's mean steps to realign over its counted switches, a switch never realigned
    counted as its whole window (censored at the phase length, so never realigning costs the most);
    None without such a switch."""
    found = counted_switches(lines)
    return float(np.mean([f["window"] if f["steps"] is None else f["steps"] for f in found])) if found else None


def realigned_share_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    """Per row, over seeds (mean ± 95 % CI) and paired by seed against the reference row: the share of
    switches realigned, and the mean steps to realign with a switch never realigned counted as its
    whole phase (`realign_steps`)."""
    stats = {"share": realigned_share, "steps": realign_steps}
    values = {(row.name, stat): {seed: v for seed, lines in runs.get(row.name, {}).items()
                                 if (v := measure(lines)) is not None}
              for row in comparison.rows for stat, measure in stats.items()}  # fmt: skip
    text = ["Per run: the share of switches realigned (%), and the mean steps to realign with a switch never "
            "realigned counted as its whole phase; mean ± 95 % CI over seeds, Δ vs the reference row paired by seed:",
            "", "| row | seeds | switches realigned % | Δ (paired) | steps to realign | Δ (paired) |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for row in comparison.rows:
        cells = []
        for stat, scale in (("share", 100.0), ("steps", 1.0)):
            by_seed, reference = values[(row.name, stat)], values[(comparison.reference, stat)]
            mean, half, n = paired_difference(by_seed, reference)
            delta = ("—" if row.name == comparison.reference or n == 0
                     else f"{scale * mean:+.1f}" + (" (1 seed)" if n == 1 else f" ± {scale * half:.1f}"))  # fmt: skip
            cells += [_fmt(*mean_ci95(list(by_seed.values())), scale=scale) if by_seed else "not run", delta]
        seeds = len(values[(row.name, "share")])
        text.append(f"| {row.label} | {seeds} | " + " | ".join(cells) + " |")
    return text


def interaction_table(suite_name: str, suite: Suite, out: Path) -> list[str]:
    """One line per `Interaction`: its mean ± 95 % CI over the seeds all four rows ran, paired by seed,
    and whether the interval excludes 0 at 95 % / 99 %."""
    if not suite.interactions:
        return []
    text = ["Interactions of final success, in points: (a − b) − (c − d) per seed, mean ± 95 % CI over the "
            "seeds all four rows ran.", "", "| interaction | seeds | value | excludes 0 at 95 % / 99 % |",
            "|---|---|---|---|"]  # fmt: skip
    for interaction in suite.interactions:
        finals = {name: {seed: run_scores(lines)["final"] for seed, lines in load_runs(out, suite_name, name).items()}
                  for name in (interaction.a, interaction.b, interaction.c, interaction.d)}  # fmt: skip
        seeds = sorted(set.intersection(*(set(by_seed) for by_seed in finals.values())))
        values = [(finals[interaction.a][s] - finals[interaction.b][s]) - (finals[interaction.c][s] - finals[interaction.d][s])
                  for s in seeds]  # fmt: skip
        if not values:
            text.append(f"| {interaction.title} | 0 | — | — |")
            continue
        mean, half = mean_ci95(values)
        value = f"{100 * mean:+.1f}" + ("" if math.isnan(half) else f" ± {100 * half:.1f}")
        robust = "—" if len(values) < 2 else " / ".join("yes" if excludes_zero(values, level) else "no"
                                                         for level in (0.95, 0.99))  # fmt: skip
        text.append(f"| {interaction.title} | {len(values)} | {value} | {robust} |")
    return text


def pretraining_points(comparison: Comparison, runs: Mapping[str, Mapping[int, list]], out: Path,
                       suite_name: str) -> list[tuple[int, str, list[tuple[float | None, float]]]]:  # fmt: skip
    """(corpus size, row label, per seed in seed order (the critic's explained variance at the end of
    value pretraining, None for a run without it; final held-out success)) per finished row, by corpus
    size; the size is `critic.pretrain_rollouts` of the runs' config.yaml."""
    points = []
    for row in comparison.rows:
        folders = finished_runs(out, suite_name, row.name)
        if not folders:
            continue
        config = yaml.safe_load((next(iter(folders.values())) / "config.yaml").read_text())
        per_seed = [(last_stage_value(lines, VALUE_PRETRAIN_STAGE, EV_KEY), run_scores(lines)["final"])
                    for _, lines in sorted(runs.get(row.name, {}).items())]  # fmt: skip
        points.append((int(config["critic"]["pretrain_rollouts"]), row.label, per_seed))
    return sorted(points, key=lambda point: point[0])


def plot_pretraining_curve(comparison: Comparison, runs: Mapping[str, Mapping[int, list]], out: Path,
                           suite_name: str) -> Path | None:  # fmt: skip
    """Value-pretraining corpus size → the critic's explained variance at the end of pretraining →
    final held-out success: mean and 95 % CI over seeds, one point per row; and per seed, EV against
    final success."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = pretraining_points(comparison, runs, out, suite_name)
    if not points:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    x = np.arange(len(points))  # one slot per corpus size (0 has no place on a log axis)
    for ax, pick, label, scale in ((axes[0], 0, "critic EV, end of value pretraining", 1.0),
                                   (axes[1], 1, "final held-out success %", 100.0)):  # fmt: skip
        stats = []
        for _, _, per_seed in points:
            values = [seed[pick] for seed in per_seed if seed[pick] is not None]
            stats.append(mean_ci95(values) if values else (math.nan, math.nan))
        ax.errorbar(x, [scale * m for m, _ in stats], yerr=[0 if math.isnan(h) else scale * h for _, h in stats],
                    marker="o", capsize=4)  # fmt: skip
        ax.set(title=label, xlabel="value-pretraining rollouts")
        ax.set_xticks(x, [str(size) for size, _, _ in points])
        ax.grid(alpha=0.3)
    for size, _, per_seed in points:
        pairs = [(ev, final) for ev, final in per_seed if ev is not None]
        if pairs:
            axes[2].scatter([ev for ev, _ in pairs], [100 * final for _, final in pairs], label=str(size), s=18)
    axes[2].set(title="per seed: EV after pretraining vs final success %", xlabel="critic EV, end of value pretraining")
    axes[2].grid(alpha=0.3)
    if axes[2].collections:
        axes[2].legend(title="rollouts", fontsize=8)
    fig.suptitle(f"{comparison.title} — mean, 95 % CI")
    fig.tight_layout()
    path = out / suite_name / f"{comparison.slug}_curve.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def phases(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's phases of one rewarded style: the first from step 0 (the evaluation before RL is
    judged against the first style), then one per switch (`realignment`); each {"start", "end"
    (exclusive; None for the last), "style", "previous" (the style rewarded before; None for the first)}."""
    switches = realignment(lines)
    first = next((line for line in sorted((l for l in lines if l.get(TARGET_STYLE_KEY) is not None),
                                          key=lambda l: l["step"])), None)  # fmt: skip
    if first is None:
        return []
    starts = [(0, first[TARGET_STYLE_KEY], None)]
    for found in switches:
        starts.append((found["switch_step"], found["style"], starts[-1][1]))
    return [{"start": start, "end": starts[k + 1][0] if k + 1 < len(starts) else None, "style": style,
             "previous": previous} for k, (start, style, previous) in enumerate(starts)]  # fmt: skip


def in_phase(step: float, phase: Mapping[str, Any]) -> bool:
    return step >= phase["start"] and (phase["end"] is None or step < phase["end"])


def phase_evaluations(lines: Sequence[Mapping[str, Any]], key: str = SUCCESS_KEY) -> list[tuple[float, float] | None]:
    """Per phase (`phases`): `key` at its first and at its last evaluation, None for a phase without one."""
    points = sorted((line["step"], line[key]) for line in lines if line.get(SUCCESS_KEY) is not None
                    and line.get(key) is not None)  # fmt: skip
    out = []
    for phase in phases(lines):
        inside = [value for step, value in points if in_phase(step, phase)]
        out.append((inside[0], inside[-1]) if inside else None)
    return out


def phase_success_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    """Held-out success per phase: at the phase's first evaluation (just after its switch: how much of
    the new style the policy still had) and at its last (how far it realigned), mean ± 95 % CI over
    seeds; then per difficulty level, the held-out success at the phases' last evaluations (mean over
    the phases, then over seeds) and the share of texts meeting the quality check at the first
    evaluation and the last."""
    reference = next((lines for by_seed in runs.values() for lines in by_seed.values() if phases(lines)), None)
    if reference is None:
        return []
    shown = phases(reference)
    header = ["row", *(f"{p['style']} from step {p['start']}" for p in shown)]
    text = ["Held-out success % per phase (evaluated against the phase's style): at the phase's first evaluation "
            "→ at its last, mean over seeds, ± the 95 % CI of the last:", "",
            "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for row in comparison.rows:
        per_run = [phase_evaluations(lines) for lines in runs.get(row.name, {}).values()]
        cells = [row.label]
        for k in range(len(shown)):
            got = [found[k] for found in per_run if len(found) > k and found[k] is not None]
            if not got:
                cells.append("—" if per_run else "not run")
                continue
            first, (last, half) = float(np.mean([g[0] for g in got])), mean_ci95([g[1] for g in got])
            cells.append(f"{100 * first:.1f} → {_fmt(last, half)}")
        text.append("| " + " | ".join(cells) + " |")
    levels = sorted({k[len(QUALITY_LEVEL_PREFIX):] for by_seed in runs.values() for lines in by_seed.values()
                     for line in lines for k in line if k.startswith(QUALITY_LEVEL_PREFIX)}, key=int)  # fmt: skip
    if not levels:
        return text
    header = ["row", *(f"level {d}: success at phase ends" for d in levels),
              *(f"level {d}: quality start → end" for d in levels)]  # fmt: skip
    text += ["", "Per difficulty level (the topics' levels): held-out success % at the phases' last evaluations "
             "(mean over the phases, then mean ± 95 % CI over seeds), and the held-out share of texts meeting the "
             "quality check % at the first evaluation → the last (mean over seeds): the levels stay unequal, or "
             "the task lost what a state-dependent baseline could know.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for row in comparison.rows:
        by_seed = list(runs.get(row.name, {}).values())
        if not by_seed:
            text.append(f"| {row.label} | " + " | ".join(["not run"] * (len(header) - 1)) + " |")
            continue
        cells = [row.label]
        for d in levels:
            found = [[p[1] for p in phase_evaluations(lines, f"{LEVEL_PREFIX}{d}") if p is not None] for lines in by_seed]
            ends = [float(np.mean(f)) for f in found if f]
            cells.append(_fmt(*mean_ci95(ends)) if ends else "—")
        for d in levels:
            _, quality = eval_curve_of(by_seed, f"{QUALITY_LEVEL_PREFIX}{d}")
            cells.append(f"{100 * quality[0]:.1f} → {100 * quality[1]:.1f}" if quality else "—")
        text.append("| " + " | ".join(cells) + " |")
    return text


def eval_curve_of(runs: Sequence[Sequence[Mapping[str, Any]]], key: str) -> tuple[int, tuple[float, float] | None]:
    """(runs that log it, (mean over them of `key` at their first evaluation, at their last))."""
    ends = []
    for lines in runs:
        values = [line[key] for line in sorted((l for l in lines if l.get(SUCCESS_KEY) is not None),
                                               key=lambda l: l["step"]) if line.get(key) is not None]  # fmt: skip
        if values:
            ends.append((values[0], values[-1]))
    if not ends:
        return 0, None
    return len(ends), (float(np.mean([e[0] for e in ends])), float(np.mean([e[1] for e in ends])))


def aligned_values(lines: Sequence[Mapping[str, Any]], key_of: Callable[[Mapping[str, Any]], str | None],
                   offsets: Sequence[int]) -> list[dict[int, float]]:
    """Per switch (`phases` after the first) whose key `key_of(phase)` is not None, {offset: value of
    that key at step switch + offset}, counting only steps inside the phase before the switch
    (offset < 0) or the phase it starts (offset ≥ 0) and RL lines that log the key."""
    by_step = {line["step"]: line for line in rl_lines(lines)}
    found = phases(lines)
    out = []
    for k in range(1, len(found)):
        key = key_of(found[k])
        if key is None:
            continue
        values = {}
        for offset in offsets:
            step = found[k]["start"] + offset
            value = by_step.get(step, {}).get(key)
            if in_phase(step, found[k] if offset >= 0 else found[k - 1]) and value is not None:
                values[offset] = float(value)
        out.append(values)
    return out


def switch_window_mean(lines: Sequence[Mapping[str, Any]], key_of, offsets: Sequence[int]) -> float | None:
    """A run's mean over its switches of the mean over the window of `aligned_values` (switches with no
    value in it left out); None when none has one."""
    means = [float(np.mean(list(values.values()))) for values in aligned_values(lines, key_of, offsets) if values]
    return float(np.mean(means)) if means else None


def critic_switch_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]],
                        warmups: Mapping[str, Mapping[int, int]]) -> list[str]:  # fmt: skip
    """The critic's explained variance before its updates around the switches: the mean over the
    `SWITCH_WINDOW` steps before each switch and over the `SWITCH_WINDOW` steps from it (each averaged
    over the run's switches), and the run's median after the critic warmup; mean ± 95 % CI over seeds.
    [] when no run logs it (critic-free rows only)."""
    columns = ((f"{SWITCH_WINDOW} steps before each switch", lambda lines, _: switch_window_mean(
                   lines, lambda _: EV_BEFORE_KEY, range(-SWITCH_WINDOW, 0))),
               (f"{SWITCH_WINDOW} steps from each switch", lambda lines, _: switch_window_mean(
                   lines, lambda _: EV_BEFORE_KEY, range(SWITCH_WINDOW))),
               ("run median after the warmup", lambda lines, warmup: median_after_warmup(lines, EV_BEFORE_KEY, warmup)))  # fmt: skip
    cells = {}
    for row in comparison.rows:
        found = [(lines, warmups.get(row.name, {}).get(seed, 0)) for seed, lines in runs.get(row.name, {}).items()]
        for header, statistic in columns:
            values = [v for v in (statistic(lines, warmup) for lines, warmup in found) if v is not None]
            cells[(row.name, header)] = _fmt_number(*mean_ci95(values), ".2f") if values else None
    if all(v is None for v in cells.values()):
        return []
    text = ["Critic explained variance before its updates, around the switches: mean over the "
            f"{SWITCH_WINDOW} steps before each switch and over the {SWITCH_WINDOW} steps from it (each averaged "
            "over the run's switches), and the run's median; mean ± 95 % CI over seeds:", "",
            "| row | " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * (len(columns) + 1)]  # fmt: skip
    for row in comparison.rows:
        text.append(f"| {row.label} | " + " | ".join(cells[(row.name, h)] or "—" for h, _ in columns) + " |")
    return text


# The styles whose first-action advantage the switch tables follow: the one rewarded before the switch
# ("old"), the one rewarded after it ("new"), and the remaining one ("other").
SWITCH_ROLES = ("old", "new", "other")
STYLE_NAMES = ("cute", "chuunibyou", "classical")  # `sao_jax.envs.judges.STYLES`, without importing the package


def role_style(phase: Mapping[str, Any], role: str) -> str | None:
    """The style of `role` at the switch that starts `phase`."""
    if role == "old":
        return phase["previous"]
    if role == "new":
        return phase["style"]
    rest = [s for s in STYLE_NAMES if s not in (phase["style"], phase["previous"])]
    return rest[0] if len(rest) == 1 else None


def role_key(role: str) -> Callable[[Mapping[str, Any]], str | None]:
    def key_of(phase):
        style = role_style(phase, role)
        return None if style is None else FIRST_ACTION_ADVANTAGE_PREFIX + style

    return key_of


def first_action_advantage_table(comparison: Comparison, runs: Mapping[str, Mapping[int, list]]) -> list[str]:
    """The mean advantage on the first action token (the style choice) of the trajectories that wrote
    the old, the new and the other style, over the `ADVANTAGE_WINDOW` steps before each switch and the
    `ADVANTAGE_WINDOW` steps from it (averaged over the run's switches, then mean ± 95 % CI over
    seeds); [] when no run logs it."""
    windows = (("before", range(-ADVANTAGE_WINDOW, 0)), ("after", range(ADVANTAGE_WINDOW)))
    columns = [(role, when, offsets) for when, offsets in windows for role in SWITCH_ROLES]
    cells = {}
    for row in comparison.rows:
        for role, when, offsets in columns:
            values = [v for lines in runs.get(row.name, {}).values()
                      if (v := switch_window_mean(lines, role_key(role), offsets)) is not None]  # fmt: skip
            cells[(row.name, role, when)] = _fmt_number(*mean_ci95(values), ".3f") if values else None
    if all(v is None for v in cells.values()):
        return []
    header = [f"{role} style, {ADVANTAGE_WINDOW} steps " + ("before the switch" if when == "before" else "from it")
              for role, when, _ in columns]
    text = ["First-action advantage by style (the mechanism of §4.5: after a switch the old style's choice should "
            "get a negative push and the new style's a positive one): the mean advantage on the first action "
            "token of the step's trajectories that wrote the style rewarded before the switch (old), after it "
            f"(new), or the third (other), over the {ADVANTAGE_WINDOW} steps before each switch and the "
            f"{ADVANTAGE_WINDOW} from it, averaged over the run's switches; mean ± 95 % CI over seeds:", "",
            "| row | " + " | ".join(header) + " |", "|" + "---|" * (len(header) + 1)]  # fmt: skip
    for row in comparison.rows:
        text.append(f"| {row.label} | " + " | ".join(cells[(row.name, r, w)] or "—" for r, w, _ in columns) + " |")
    return text


def plot_switch_advantages(comparison: Comparison, runs: Mapping[str, Mapping[int, list]], folder: Path) -> Path | None:
    """OUT/<suite>/first_action_advantage.png: one panel per row, the first-action advantage of the
    old, new and other style against the steps since a switch (mean over the run's switches, then
    over seeds, 95 % band over seeds); None when no run logs it."""
    import matplotlib.pyplot as plt

    span = max((p["end"] - p["start"] for by_seed in runs.values() for lines in by_seed.values()
                for p in phases(lines) if p["end"] is not None), default=0)  # fmt: skip
    offsets = list(range(-ADVANTAGE_WINDOW, span))
    drawn = False
    fig, axes = plt.subplots(1, len(comparison.rows), figsize=(6 * len(comparison.rows), 3.8), squeeze=False)
    for ax, row in zip(axes[0], comparison.rows):
        seeds = list(runs.get(row.name, {}).values())
        for i, role in enumerate(SWITCH_ROLES):
            per_run = []  # per run: {offset: mean over its switches}
            for lines in seeds:
                by_offset: dict[int, list[float]] = {}
                for switch in aligned_values(lines, role_key(role), offsets):
                    for offset, value in switch.items():
                        by_offset.setdefault(offset, []).append(value)
                per_run.append({o: float(np.mean(v)) for o, v in by_offset.items()})
            steps = [o for o in offsets if sum(o in r for r in per_run) >= 1]
            if not steps:
                continue
            stats = [mean_ci95([r[o] for r in per_run if o in r]) for o in steps]
            _band(ax, np.asarray(steps, float), *(np.asarray(v, float) for v in zip(*stats)), f"{role} style",
                  color=f"C{i}")
            drawn = True
        ax.axvline(0, color="k", linestyle="--", linewidth=0.8)
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.set(title=f"{row.label} (n={len(seeds)})", xlabel="steps since the switch", ylabel="first-action advantage")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if not drawn:
        plt.close(fig)
        return None
    fig.suptitle("Advantage on the first action token (the style choice) by the style written, around the switches")
    fig.tight_layout()
    path = folder / "first_action_advantage.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _band(ax, steps, mean, half, label, color=None):
    (line,) = ax.plot(steps, mean, label=label, color=color)
    if len(half) and not np.all(np.isnan(half)):
        ax.fill_between(steps, mean - half, mean + half, color=line.get_color(), alpha=0.2)


def plot_comparison(comparison: Comparison, runs: Mapping[str, Mapping[int, list]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    panels = ((SUCCESS_KEY, "held-out success"), *comparison.per_step)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for row in comparison.rows:
            seeds = list(runs.get(row.name, {}).values())
            if seeds:
                _band(ax, *per_step(seeds, key), f"{row.label} (n={len(seeds)})")
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{comparison.title} — mean, 95 % CI band")
    fig.tight_layout()
    written.append(folder / f"{comparison.slug}.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    if comparison.styles:
        written.append(_plot_styles(comparison, runs, folder))
    if comparison.switches:
        advantages = plot_switch_advantages(comparison, runs, folder)
        if advantages is not None:
            written.append(advantages)
    grad_norms = plot_grad_norms(comparison, runs, folder)
    if grad_norms is not None:
        written.append(grad_norms)
    return written


def grad_norm_panels(runs: Mapping[str, Mapping[int, list]]) -> tuple[list[list[str]], list[str]]:
    """The gradient-norm keys to plot: [critic keys, policy keys] (each the total `<model>/grad_norm`
    then its groups of `GRAD_NORM_GROUPS`) logged on some RL step, less those 0 on every RL step of
    every run, which are returned second."""
    values: dict[str, list[float]] = {}
    for by_seed in runs.values():
        for lines in by_seed.values():
            for line in rl_lines(lines):
                for key, value in line.items():
                    if value is not None and key.startswith(("critic/grad_norm", "policy/grad_norm")):
                        values.setdefault(key, []).append(value)
    panels, zero = [], []
    for model in ("critic", "policy"):
        keys = [k for k in (f"{model}/grad_norm", *(f"{model}/grad_norm/{g}" for g in GRAD_NORM_GROUPS)) if k in values]
        zero += [k for k in keys if all(v == 0 for v in values[k])]
        panels.append([k for k in keys if k not in zero])
    return [keys for keys in panels if keys], zero


def plot_grad_norms(comparison: Comparison, runs: Mapping[str, Mapping[int, list]], folder: Path) -> Path | None:
    """OUT/<suite>/<slug>_grad_norms.png: per gradient-norm key (`grad_norm_panels`; critic on the top
    line of panels, policy below), each row's mean over seeds per RL step, log y; None when no run logs
    a gradient norm. A row whose mean is 0 throughout is labelled so (log y cannot show it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels, zero = grad_norm_panels(runs)
    if not panels:
        return None
    width = max(len(keys) for keys in panels)
    fig, axes = plt.subplots(len(panels), width, figsize=(4.2 * width, 3.4 * len(panels)), squeeze=False)
    for line_of_axes, keys in zip(axes, panels):
        for ax, key in zip(line_of_axes, keys):
            for i, row in enumerate(comparison.rows):
                seeds = [rl_lines(lines) for lines in runs.get(row.name, {}).values()]
                if not seeds or not any(line.get(key) is not None for lines in seeds for line in lines):
                    continue
                steps, mean, _ = per_step(seeds, key)
                positive = mean > 0
                label = f"{row.label} (n={len(seeds)})" + ("" if positive.any() else ", 0 throughout")
                ax.plot(steps, np.where(positive, mean, np.nan), color=f"C{i}", label=label)
            ax.set_yscale("log")
            ax.set(title=key, xlabel="step")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        for ax in line_of_axes[len(keys):]:
            ax.axis("off")
    title = f"{comparison.title}\ngradient L2 norm (total, per module group): mean over seeds per RL step, log scale"
    zero_groups = {model: [k.split("/")[-1] for k in zero if k.startswith(model)] for model in ("critic", "policy")}
    if zero:
        title += "\n0 at every step of every run, not drawn: " + "; ".join(
            f"{model} {', '.join(groups)}" for model, groups in zero_groups.items() if groups)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = folder / f"{comparison.slug}_grad_norms.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_styles(comparison: Comparison, runs: Mapping[str, Mapping[int, list]], folder: Path) -> Path:
    """One panel per row: each style's per-step share (mean over seeds, 95 % band), on a background
    tinted with the colour of the style rewarded in that phase."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(comparison.rows), figsize=(7 * len(comparison.rows), 4.2), squeeze=False)
    colours: dict[str, str] = {}
    for ax, row in zip(axes[0], comparison.rows):
        seeds = list(runs.get(row.name, {}).values())
        keys = sorted({k for lines in seeds for line in lines for k in line if k.startswith(STYLE_SHARE_PREFIX)})
        for key in keys:
            style = key[len(STYLE_SHARE_PREFIX):]
            colours.setdefault(style, f"C{len(colours)}")
            _band(ax, *per_step(seeds, key), style, color=colours[style])
        switches = realignment(seeds[0]) if seeds else []
        first = next((line for line in seeds[0] if line.get(TARGET_STYLE_KEY) is not None), None) if seeds else None
        if first is not None:  # the phase before the first switch
            ax.axvspan(first["step"], switches[0]["switch_step"] if switches else first["step"] + 1,
                       color=colours.get(first[TARGET_STYLE_KEY], "grey"), alpha=0.12, linewidth=0)
        for found in switches:
            end = found["switch_step"] + found["window"]
            ax.axvspan(found["switch_step"], end, color=colours.get(found["style"], "grey"), alpha=0.12, linewidth=0)
            ax.axvline(found["switch_step"], color="k", linestyle="--", linewidth=0.8)
        ax.set(title=f"{row.label} (n={len(seeds)})", xlabel="step", ylabel="share of trajectories", ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(keys))
    fig.suptitle("Per-step share of each style; background: the rewarded style after each switch (dashed)")
    fig.tight_layout()
    path = folder / "style_share.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def calibration_notes(paths: Sequence[Path]) -> list[str]:
    """One line per seed's ESTR calibration file, flagging a vacuous match (DIS masks nothing)."""
    if not paths:
        return []
    text = ["", "ESTR τ calibrated per seed at step 0 (to DIS's masked fraction on a rollout of the starting policy):",
            ""]
    for path in paths:
        c = json.loads(path.read_text())
        text.append(f"- {path.parent.name}: τ = {c['estr_tau']:.4g}; masked fraction DIS {c['dis_masked_fraction']:.4%}, "
                    f"ESTR {c['estr_masked_fraction']:.4%} of {c['action_tokens']} action tokens; "
                    f"max |log π_θ − log μ| = {c['max_abs_log_ratio']:.3g}")  # fmt: skip
        if c["dis_masked_fraction"] == 0:
            text[-1] += (" — DIS masks nothing at step 0 (no train/inference mismatch), so τ sits at float-noise "
                         "scale and ESTR drops nearly every off-policy token")
    return text


def write_report(suite_name: str, out: Path) -> Path:
    """OUT/<suite>.md and OUT/<suite>/*.png from the finished runs' metrics.jsonl files."""
    suite = SUITES[suite_name]
    out = Path(out)
    text = [f"# {suite_name}: reproduction of the paper's ablations", "",
            f"Generated by `scripts/reproduce.py` from `{out / suite_name}/<row>/seed<k>/metrics.jsonl` (finished "
            "runs only). Success is held-out success in %, mean ± 95 % CI (t, n−1 df) over seeds; AUC = area "
            "under the held-out success curve / the steps it spans. Δ is the row minus the reference row, "
            "paired by seed (a seed's runs share their warm start and prompts), mean ± 95 % CI; beside it, "
            "whether that interval excludes 0 at 95 % and at 99 % (t_{0.995, n−1}, a robustness reading: the "
            "rows are several comparisons against one reference, uncorrected). The paper's "
            "numbers are its benchmarks (not this task): only the direction of each row against the "
            "reference row is comparable."]  # fmt: skip
    for comparison in suite.comparisons:
        runs = {row.name: load_runs(out, suite_name, row.name) for row in comparison.rows}
        warmups = {row.name: load_warmups(out, suite_name, row.name, runs[row.name]) for row in comparison.rows}
        text += ["", f"## {comparison.title}", "", *comparison_table(comparison, runs)]
        for table in (per_seed_table(comparison, runs), diagnostics_table(comparison, runs, warmups)):
            text += ["", *table] if table else []
        if comparison.styles:
            text += ["", *realignment_table(comparison, runs)]
        if comparison.switches:
            for table in (phase_success_table(comparison, runs), critic_switch_table(comparison, runs, warmups),
                          first_action_advantage_table(comparison, runs)):  # fmt: skip
                text += ["", *table] if table else []
        plots = plot_comparison(comparison, runs, out / suite_name)
        if comparison.pretraining_curve and (curve := plot_pretraining_curve(comparison, runs, out, suite_name)):
            plots.append(curve)
        text += ["", *(f"![{p.stem}]({suite_name}/{p.name})" for p in plots)]
        folders = [out / suite_name / row.name for row in comparison.rows]
        text += calibration_notes([p for folder in folders for p in sorted(folder.glob(f"seed*/{ESTR_CALIBRATION_FILE}"))])
    interactions = interaction_table(suite_name, suite, out)
    text += ["", "## Interactions", "", *interactions] if interactions else []
    path = out / f"{suite_name}.md"
    path.write_text("\n".join(text) + "\n")
    return path


# ------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    from sao_jax.cli import set_xla_flags

    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, choices=[*SUITES, "all"])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per row (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, tiny budgets, under OUT/quick/")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--report-only", action="store_true", help="write the tables and plots, run nothing")
    parser.add_argument("--status", action="store_true",
                        help="print which runs under OUT are done, started (RL steps logged) or not started; run nothing")  # fmt: skip
    parser.add_argument("--rows", nargs="+", default=None, help="run only these rows of the suite (the report has all)")
    parser.add_argument("--archive", type=Path, default=None,
                        help="copy the finished runs under OUT to ARCHIVE (compressed metrics, summary, config; "
                             "no checkpoints), then write the report from ARCHIVE")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="key.sub=value for every run (after the config and --quick)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1 (got {args.seeds})")
    from sao_jax.train.signals import Interrupted, exit_status

    try:
        return _reproduce(args)
    except Interrupted as stopped:
        saved = "" if stopped.step is None else f" at RL step {stopped.step}, saved"
        print(f"interrupted by {signal.Signals(stopped.signum).name}{saved}; rerun the same command to resume "
              "the suite", file=sys.stderr)  # fmt: skip
        return exit_status(stopped.signum)


def _reproduce(args: argparse.Namespace) -> int:
    """`main` after the arguments are parsed: run, archive and report each suite; 1 if a run failed."""
    out = args.out / "quick" if args.quick else args.out
    seeds = 1 if args.quick else args.seeds
    failed = []
    for name in SUITES if args.suite == "all" else [args.suite]:
        if args.status:
            print(suite_status(name, seeds, out))
            continue
        if not args.report_only:
            import jax

            # Rows share most programs: compile each once for the whole suite.
            jax.config.update("jax_compilation_cache_dir", str((out / ".jax_cache").resolve()))
            failed += run_suite(name, seeds, out, overrides=args.overrides, quick=args.quick,
                                rows=args.rows)["failed"]
        if args.archive is not None:
            for folder in archive_runs(out, name, args.archive):
                print(f"archived {folder}")
        print(f"report: {write_report(name, out if args.archive is None else args.archive)}")
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
