"""The main job over many seeds: does every seed's warm start land in the same place, and does every
seed learn?

    python scripts/seed_sweep.py --seeds 10-29                      # the default `sao-train`, 20 seeds
    python scripts/seed_sweep.py --seeds 100-104 --warm-start-only  # SFT and the step-0 evaluation only
    python scripts/seed_sweep.py --seeds 10-29 --config FILE key.sub=value ...

Each seed runs in OUT/seed_S (default runs/seed_sweep) and is skipped when it has finished there, so
an interrupted sweep continues where it stopped. The table goes to REPORT (default
results/seed_sweep.md, or results/seed_sweep_warm_start.md): per seed the SFT steps, the probed
demonstration probability, held-out success at step 0 and at the end, the estimator's share of tool
calls at step 0, the gain and the wall time; below it the distribution (min / median / max) and the
step-0 spread.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def parse_seeds(text: str) -> list[int]:
    """"10-29" or "1,5,7" (or a mix: "0-2,9") -> the seeds, in order."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds += list(range(int(first), int(last) + 1)) if last else [int(first)]
    return seeds


def warm_start_only(config) -> dict:
    """SFT, then the held-out evaluation of the warm-started policy (no value pretraining, no RL)."""
    from flax import nnx

    from sao_jax.metrics import MetricsWriter, read_metrics
    from sao_jax.train import build, evaluation, warm_start
    from sao_jax.train import steps as steps_lib

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    run = build.build_run(config)
    with MetricsWriter(out, tensorboard=False) as writer:
        params = warm_start.run_sft(run, writer)
        graph, _, buffers = steps_lib.split_model(run.policy)
        weights = nnx.state(nnx.merge(graph, params, buffers))
        writer.write(0, evaluation.evaluate(run, run.agent_loop(greedy=config.env.eval_greedy), weights))
    return evaluation.run_summary(read_metrics(out / "metrics.jsonl"), num_eval_prompts=len(run.eval_prompts), steps=0)


def run_seed(args, seed: int) -> dict:
    from sao_jax.config import load_config
    from sao_jax.metrics import read_metrics
    from sao_jax.train import loop

    folder = Path(args.out) / f"seed_{seed}"
    done = folder / ("warm_start.json" if args.warm_start_only else "summary.json")
    if done.exists():
        return json.loads(done.read_text())
    config = load_config(args.config, [*args.overrides, f"seed={seed}", f"output_dir={folder}"])
    started = time.perf_counter()
    summary = warm_start_only(config) if args.warm_start_only else loop.train(config, resume=True)
    step0 = next(line for line in read_metrics(folder / "metrics.jsonl") if "eval/success_rate" in line)
    summary = {**summary, "seed": seed, "wall_s": time.perf_counter() - started,
               "estimator_share_start": step0.get("eval/tool_share/est")}  # fmt: skip
    done.write_text(json.dumps(summary, indent=2))
    return summary


def report(rows: list[dict], *, warm_start: bool, command: str) -> str:
    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}"

    lines = [f"# Seed sweep{' (warm start only)' if warm_start else ''}", "", f"`{command}`", "",
             "| seed | SFT steps | demo. prob. | reached | step 0 % | est. share % | end % | gain (points) | learned | wall s |",
             "|---:|---:|---:|:---:|---:|---:|---:|---:|:---:|---:|"]  # fmt: skip
    for r in rows:
        w = r["warm_start"]
        prob = "—" if w["demonstration_probability"] is None else f"{w['demonstration_probability']:.2f}"
        lines.append(f"| {r['seed']} | {w['sft_steps']} | {prob} | {'yes' if w['reached_target'] else 'no'} | "
                     f"{pct(r['eval_success_start'])} | {pct(r['estimator_share_start'])} | "
                     f"{'—' if warm_start else pct(r['eval_success_end'])} | "
                     f"{'—' if r.get('gain') is None else format(100 * r['gain'], '+.1f')} | "
                     f"{'—' if r.get('learned') is None else ('yes' if r['learned'] else 'no')} | {r['wall_s']:.0f} |")
    start = np.array([r["eval_success_start"] for r in rows]) * 100

    def spread(name, x):
        return f"- {name}: min {x.min():.1f}, median {np.median(x):.1f}, max {x.max():.1f} (max − min {x.max() - x.min():.1f})"

    lines += ["", f"{len(rows)} seeds.", spread("step-0 held-out success (%)", start)]
    if not warm_start:
        gains = np.array([r["gain"] for r in rows]) * 100
        lines += [spread("gain (points)", gains), spread("end held-out success (%)", start + gains),
                  f"- seeds that gained ≥ 15 points: {int((gains >= 15).sum())} of {len(rows)}; "
                  f"judged learned: {sum(r['learned'] for r in rows)} of {len(rows)}"]
    wall = np.array([r["wall_s"] for r in rows])
    lines.append(f"- wall time per seed (s): min {wall.min():.0f}, median {np.median(wall):.0f}, max {wall.max():.0f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from sao_jax.cli import set_xla_flags

    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="10-29", help='e.g. "10-29" or "1,5,7"')
    parser.add_argument("--config", help="YAML config file (default: the embedded default)")
    parser.add_argument("--warm-start-only", action="store_true", help="SFT and the step-0 evaluation only")
    parser.add_argument("--out", default="runs/seed_sweep")
    parser.add_argument("--report")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides for every seed")
    args = parser.parse_args(argv)
    if args.warm_start_only and args.out == "runs/seed_sweep":
        args.out = "runs/seed_sweep_warm_start"
    report_path = Path(args.report or f"results/seed_sweep{'_warm_start' if args.warm_start_only else ''}.md")
    command = " ".join(["python scripts/seed_sweep.py", f"--seeds {args.seeds}",
                        *(["--warm-start-only"] if args.warm_start_only else []),
                        *([f"--config {args.config}"] if args.config else []), *args.overrides])  # fmt: skip
    rows = []
    for seed in parse_seeds(args.seeds):
        rows.append(run_seed(args, seed))
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(report(rows, warm_start=args.warm_start_only, command=command))
        r = rows[-1]
        print(f"seed {seed}: step 0 {100 * r['eval_success_start']:.1f}%"
              + ("" if args.warm_start_only else f", end {100 * r['eval_success_end']:.1f}%")
              + f", SFT {r['warm_start']['sft_steps']} steps, {r['wall_s']:.0f} s", flush=True)
    print(f"report: {report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
