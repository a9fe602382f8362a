"""Held-out evaluation and the run's verdict: the metric lines of a set of trajectories, the held-out
evaluation of a policy or of a run's newest checkpoint, and `summary.json`'s start, end and gain.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sao_jax.checkpoint import Checkpointer, ResumeError, abstract_state
from sao_jax.config import Config, to_dict
from sao_jax.envs.judges import STYLES
from sao_jax.rollout.agent_loop import AgentLoop
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import steps as steps_lib
from sao_jax.train.build import Run, build_run, checkpoint_dir, make_optimizers, new_critic, policy_weights


def rollout_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Reward, success, turns, action tokens, errors and truncations; for scaffold episodes also the
    prefix mismatches (`{prefix}/prefix_mismatch`: new segments the server started) and the action
    tokens of the earlier segments, not trained on (`{prefix}/dropped_action_tokens`)."""
    rewards = np.array([t.outcome_reward for t in trajectories])
    scaffold = [t.info for t in trajectories if "prefix_mismatches" in t.info]
    if scaffold:
        extra = {f"{prefix}/prefix_mismatch": float(sum(i["prefix_mismatches"] for i in scaffold)),
                 f"{prefix}/dropped_action_tokens": float(sum(i["dropped_action_tokens"] for i in scaffold))}
    else:
        extra = {}
    return extra | {
        f"{prefix}/trajectories": len(trajectories),
        f"{prefix}/reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        f"{prefix}/success_rate": float((rewards >= 1.0).mean()) if len(rewards) else 0.0,
        f"{prefix}/num_turns": float(np.mean([t.info.get("num_turns", 0) for t in trajectories])),
        f"{prefix}/action_tokens": float(np.mean([t.action_mask.sum() for t in trajectories])),
        f"{prefix}/env_errors": float(sum(t.info.get("error") is not None for t in trajectories)),
        f"{prefix}/truncated": float(sum(t.info.get("truncated") is not None for t in trajectories)),
    }


def tool_metrics(trajectories: list[Trajectory], prefix: str, env_cls) -> dict[str, float]:
    """Share of the answered trajectories that called each of the environment's tools (environments
    with `tool_names`, whose answers report the `tools` called)."""
    if not hasattr(env_cls, "tool_names"):
        return {}
    called = [t.info.get("env_info", {}).get("tools") for t in trajectories]
    called = [tools for tools in called if tools is not None]
    return {f"{prefix}/tool_share/{name}": sum(name in tools for tools in called) / max(len(called), 1)
            for name in env_cls.tool_names()}  # fmt: skip


def repair_metrics(trajectories: list[Trajectory], prefix: str, env_cls) -> dict[str, float]:
    """Environments that allow a second answer after a failed test (`attempts` > 1, the repair task):
    the share of trajectories with a wrong answer (a failed test) and the share repaired (right on the
    second attempt; held-out success counts only the first)."""
    if getattr(env_cls, "attempts", 1) < 2:
        return {}
    infos = [t.info.get("env_info", {}) for t in trajectories]
    n = max(len(infos), 1)
    return {f"{prefix}/failed_test_share": sum(bool(i.get("failed_test")) for i in infos) / n,
            f"{prefix}/repaired_share": sum(bool(i.get("repaired")) for i in infos) / n}


def difficulty_metrics(trajectories: list[Trajectory], prompts, prefix: str) -> dict[str, float]:
    """Success rate (outcome reward ≥ 1) per difficulty level, `{prefix}/success_rate/level_<d>`, when
    the prompts span more than one level (e.g. the chain task's 1-4 links): where the errors left are."""
    level = {p.id: p.difficulty for p in prompts}
    levels = sorted({level[t.prompt_id] for t in trajectories})
    if len(levels) < 2:
        return {}
    return {f"{prefix}/success_rate/level_{d}": float(np.mean([t.outcome_reward >= 1.0 for t in trajectories
                                                               if level[t.prompt_id] == d]))
            for d in levels}  # fmt: skip


def style_metrics(trajectories: list[Trajectory], schedule) -> dict[str, Any]:
    """Online experiment (style_shift): the rewarded style and each style's share of the trajectories."""
    if schedule is None:
        return {}
    styles = [t.info.get("env_info", {}).get("style") for t in trajectories]
    shares = {f"train/style_share/{s}": styles.count(s) / max(len(styles), 1) for s in STYLES}
    return {"train/target_style": schedule.current_style, **shares}


NO_STYLE = "none"  # a text with no style marker, or a tie (`judges.style_of` is None)


def style_advantage_metrics(trajectories: list[Trajectory], first_action_advantages, schedule) -> dict[str, Any]:
    """Online experiment: the mean advantage on the first action token (where the style is chosen) of
    the trajectories that wrote each style, `train/first_action_advantage/<style>` (`none`: no style);
    None for a style no trajectory of the step wrote. `first_action_advantages[i]` belongs to
    `trajectories[i]` (the batch's rows in order; padding rows after them)."""
    if schedule is None or first_action_advantages is None:
        return {}
    values = np.asarray(first_action_advantages, np.float64)[: len(trajectories)]
    styles = [t.info.get("env_info", {}).get("style") or NO_STYLE for t in trajectories]
    out = {}
    for style in (*STYLES, NO_STYLE):
        chose = [v for v, s in zip(values, styles) if s == style]
        out[f"train/first_action_advantage/{style}"] = float(np.mean(chose)) if chose else None
    return out


def quality_metrics(trajectories: list[Trajectory], prompts, prefix: str) -> dict[str, float]:
    """Judged tasks (the style-shift family, whose answers report `quality`): the share of trajectories
    meeting the quality check, `{prefix}/quality_rate`, and per difficulty level
    `{prefix}/quality_rate/level_<d>` when the prompts span more than one (the topics' pass rates)."""
    judged = [t for t in trajectories if "quality" in t.info.get("env_info", {})]
    if not judged:
        return {}
    level = {p.id: p.difficulty for p in prompts}

    def rate(group):
        return float(np.mean([t.info["env_info"]["quality"] for t in group]))

    out = {f"{prefix}/quality_rate": rate(judged)}
    levels = sorted({level[t.prompt_id] for t in judged})
    if len(levels) > 1:
        out |= {f"{prefix}/quality_rate/level_{d}": rate([t for t in judged if level[t.prompt_id] == d])
                for d in levels}  # fmt: skip
    return out


def evaluate(run: Run, eval_loop: AgentLoop, weights) -> dict[str, float]:
    """Held-out success (outcome reward ≥ 1) with a fixed evaluation key: greedy decoding when
    `env.eval_greedy`, else the rollout sampling settings (temperature 1 by default)."""
    trajectories = eval_loop.rollout((weights, 0), run.eval_prompts, jax.random.key(0))
    return (rollout_metrics(trajectories, "eval") | tool_metrics(trajectories, "eval", run.env_cls)
            | repair_metrics(trajectories, "eval", run.env_cls)
            | difficulty_metrics(trajectories, run.eval_prompts, "eval")
            | quality_metrics(trajectories, run.eval_prompts, "eval"))


def evaluate_checkpoint(config: Config) -> dict[str, Any]:
    """Held-out evaluation of the newest readable checkpoint under `config.output_dir`."""
    run = build_run(config)
    policy_tx, critic_tx = make_optimizers(config)
    critic = new_critic(run.policy, config)
    state, graphs = steps_lib.make_train_state(
        run.policy, critic, policy_tx, critic_tx, config, num_prompts=len(run.train_prompts)
    )
    with Checkpointer(checkpoint_dir(config), config=to_dict(config)) as checkpointer:
        # Evaluation settings may differ from training's; a model that does not fit the arrays cannot.
        restored = checkpointer.restore_latest(abstract_state(run.cluster.place(state)), allow_config_change=True)
    if restored is None:
        raise ResumeError(f"no checkpoint in {checkpointer.directory}")
    weights = policy_weights(restored.state, graphs)
    return {"step": restored.step, **evaluate(run, run.agent_loop(greedy=config.env.eval_greedy), weights)}


def run_summary(lines: list[dict[str, Any]], *, num_eval_prompts: int, steps: int | None = None,
                skipped_prompts: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """summary.json from the run's metric lines: the warm start (SFT steps taken, the last probed
    demonstration probability, whether it reached its target), the RL steps trained (`steps`; None:
    counted in the lines, a step without usable data not counted), held-out success at the start (step 0)
    and at the last evaluation after it (None when none ran: never the start's again), the gain, and
    whether the run learned: the gain exceeds twice its standard error,

        learned ⇔ end − start > 2 · sqrt((p₀(1 − p₀) + p₁(1 − p₁)) / n),   n = held-out prompts,

    so a gain that sampling noise of the evaluation alone could make does not count. `skipped_prompts`
    ({"env.train_file": n, ...}: prompts left out of the files under env.bad_prompts=skip) is kept
    under that name where any was."""
    sft = [line for line in lines if line.get("stage") == "sft"]
    probes = [line["sft/demonstration_probability"] for line in sft if "sft/demonstration_probability" in line]
    warm_start = {
        "sft_steps": int(sft[-1]["sft/step"]) + 1 if sft else 0,
        "demonstration_probability": probes[-1] if probes else None,
        "reached_target": bool(sft[-1].get("sft/stopped_at_target", 0)) if sft else None,
    }
    if steps is None:
        steps = len({line["step"] for line in lines if line.get("step", 0) > 0 and not line.get("train/skipped_no_data")})
    evals = [(line["step"], line["eval/success_rate"]) for line in lines if "eval/success_rate" in line]
    start = evals[0][1] if evals and evals[0][0] == 0 else None
    end = evals[-1][1] if evals and evals[-1][0] > 0 else None
    summary: dict[str, Any] = {"warm_start": warm_start, "steps": steps, "eval_success_start": start,
                               "eval_success_end": end}  # fmt: skip
    if skipped_prompts:
        summary["skipped_prompts"] = dict(skipped_prompts)
    if start is not None and end is not None:
        standard_error = float(np.sqrt((start * (1 - start) + end * (1 - end)) / num_eval_prompts))
        summary |= {"gain": end - start, "gain_standard_error": standard_error,
                    "learned": bool(end - start > 2 * standard_error)}  # fmt: skip
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    """The run's outcome in one line, for the console."""
    if summary.get("gain") is None:
        return "held-out success: not evaluated twice (no verdict)"
    start, end, gain = (100 * summary[k] for k in ("eval_success_start", "eval_success_end", "gain"))
    verdict = ("learned" if summary["learned"] else
               f"did not learn (the gain is within twice its standard error, {200 * summary['gain_standard_error']:.1f} points)")
    return f"held-out success {start:.1f}% -> {end:.1f}% ({gain:+.1f} points in {summary['steps']} RL steps): {verdict}"
