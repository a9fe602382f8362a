"""`sao-train [--config FILE] [--resume] [--debug] [key.sub=value ...]`: SFT → value pretraining → SAO RL.

With no arguments it runs the embedded default: the calculator-tool task, a tiny MoE policy and critic,
on the CPU. `--gae-demo` instead prints skip- vs cross-observation GAE on one multi-turn trajectory.
Several processes (one per host) make one run when each is started with `--distributed` (pods,
clusters) or `--coordinator HOST:PORT --num-processes N --process-id I` (`sao_jax.train.distributed`).
A user's mistake (a key, a value, a file or a folder: `sao_jax.errors.UserError`) is one stderr line
`error: …` and exit 2 before any work is done; `--debug` shows its traceback too. A fault that stops
the run partway (`sao_jax.errors.RunError`: an environment that fails every rollout) is one line too,
exit 3; `--debug` also logs the first failed rollout's traceback in full.
"""


from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

import numpy as np

from sao_jax.config import load_config
from sao_jax.errors import RunError, UserError
from sao_jax.outputs import join


# `sao-train --help`'s epilog: how a run ends.
EXIT_STATUSES = """\
exit status: 0 the run finished; 2 a mistake in the arguments, config or folder (one line `error: ...`,
nothing done); 1 a checkpoint could not be saved (one line `error: ...` naming the folder and the
cause; the earlier checkpoints, summary.json and plots of the steps trained are kept); 143 after
SIGTERM, 130 after SIGINT (128 + the signal): the step in hand was finished and saved, one line
`interrupted ...`, and --resume continues from it. A second signal ends the process at once;
train.signal_grace_s (default 25) bounds the stop."""


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with the options every command shares."""
    parser.add_argument("--config", help="YAML config file (may name `base:`)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied last")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a user error (a bad key, file or folder) or of a fault that "
                             "stops the run, and the first failed rollout's in full")
    processes = parser.add_argument_group(
        "multi-process runs", "one process per host, every process started with the same config and overrides")
    processes.add_argument("--distributed", action="store_true",
                           help="join a multi-process run whose coordinator, process count and process id are "
                                "detected (Cloud TPU pods, SLURM, ...)")
    processes.add_argument("--coordinator", metavar="HOST:PORT",
                           help="join a multi-process run coordinated by process 0 at HOST:PORT "
                                "(needs --num-processes and --process-id)")
    processes.add_argument("--num-processes", type=int, metavar="N")
    processes.add_argument("--process-id", type=int, metavar="I", help="this process, 0 <= I < N")
    args = parser.parse_args(argv)
    explicit = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in explicit) and None in explicit:
        parser.error("--coordinator, --num-processes and --process-id go together")
    return args


# XLA:CPU's default scheduler orders a program so that independent ops can run at once, and keeps
# their buffers alive together. In a TTUR step (K critic updates, then a policy update) that keeps
# every update's temporaries at the same time, and the one program runs slower than the same updates
# called one by one; with the memory-ordered scheduler it is the faster (benchmarks/RESULTS.md). The
# option is read from XLA_FLAGS when the first backend starts (`jax.jit(compiler_options=...)` does
# not reach it), so the entry points set it before any JAX call: `sao-train` and `sao-eval` (`_load`),
# tests/conftest.py, and the scripts and benchmarks that run the steps. Other backends ignore it.
CPU_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"


def set_xla_flags(environ=os.environ) -> None:
    """Adds `--xla_cpu_enable_concurrency_optimized_scheduler=false` to `environ["XLA_FLAGS"]` (see
    `CPU_SCHEDULER_FLAG`), unless XLA_FLAGS names the option already. For entry points, before the
    first JAX backend starts; importing `sao_jax` sets nothing."""
    flags = environ.get("XLA_FLAGS", "")
    if CPU_SCHEDULER_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} --{CPU_SCHEDULER_FLAG}=false".strip()


def jax_flags(config) -> dict[str, object]:
    """The JAX config flags a run's config sets: {flag: value}. Applied by the entry points (`_load`),
    never at import of the library, so importing `sao_jax` changes no JAX setting."""
    return {"jax_ragged_dot_use_gpu_pallas_triton_lowering": config.model.ragged_dot_triton}


def _load(args: argparse.Namespace):
    """The config of `args`; then sets XLA_FLAGS (`set_xla_flags`), joins a multi-process run when the
    flags ask for one (before any other JAX call) and sets the config's JAX flags (`jax_flags`)."""
    config = load_config(args.config, args.overrides)
    set_xla_flags()
    if args.distributed or args.coordinator is not None:
        from sao_jax.train.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    for flag, value in jax_flags(config).items():
        jax.config.update(flag, value)
    return config


def _user_errors_exit_2(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`command(args)`; a `UserError` becomes one stderr line `error: …` and exit 2, a `RunError` one line
    and its `exit_status` (both raised with --debug)."""
    try:
        return command(args)
    except (UserError, RunError) as e:
        if args.debug:
            raise
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return e.exit_status if isinstance(e, RunError) else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sao-train", description=__doc__.split("\n\n")[0], epilog=EXIT_STATUSES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest readable checkpoint, or start from the beginning if there is none")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="with --resume: continue even if the config differs from the checkpoint's")
    parser.add_argument("--gae-demo", action="store_true", help="print the GAE demo table and exit")
    return _user_errors_exit_2(_train, _parse(parser, argv))


def _train(args: argparse.Namespace) -> int:
    config = _load(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sao_jax").setLevel(logging.DEBUG if args.debug else logging.INFO)
    if args.gae_demo:
        print(gae_demo(gamma=config.advantage.gamma, lam=config.advantage.lam_policy))
        return 0
    from sao_jax.checkpoint import CheckpointSaveError
    from sao_jax.train.evaluation import summary_line
    from sao_jax.train.loop import train
    from sao_jax.train.signals import Interrupted, exit_status

    try:
        summary = train(config, resume=args.resume, allow_config_change=args.allow_config_change)
    except Interrupted as stopped:
        print(stopped, file=sys.stderr)
        return exit_status(stopped.signum)
    except CheckpointSaveError as error:
        if args.debug:
            raise
        print(f"error: {error} (the earlier checkpoints are kept: --resume continues from the newest)", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    print(summary_line(summary))
    print(f"metrics: {join(config.output_dir, 'metrics.jsonl')}   plots: {join(config.output_dir, 'plots')}")
    return 0


def evaluate_main(argv: list[str] | None = None) -> int:
    """`sao-eval [--config FILE] [key.sub=value ...]`: held-out success of the newest checkpoint in
    output_dir (pass the same config as the run that wrote it)."""
    parser = argparse.ArgumentParser(prog="sao-eval", description=evaluate_main.__doc__.split("\n")[0])
    return _user_errors_exit_2(_evaluate, _parse(parser, argv))


def _evaluate(args: argparse.Namespace) -> int:
    config = _load(args)
    from sao_jax.train.evaluation import evaluate_checkpoint

    result = evaluate_checkpoint(config)
    print(json.dumps(result, indent=2))
    return 0


# A calculator-tool episode: the policy writes a tool call, the environment answers, the policy answers.
DEMO_SPANS = (
    ("prompt", "Q: 17*3+4=?"),
    ("action", "<calc>17*3</calc>"),
    ("observation", "<out>51</out>"),
    ("action", "<calc>51+4</calc>"),
    ("observation", "<out>55</out>"),
    ("action", "A: 55"),
)


def gae_demo(*, gamma: float, lam: float) -> str:
    """Markdown table: per span, the rewards, values and both GAE variants' mean advantage."""
    import jax.numpy as jnp

    from sao_jax.advantages import cross_observation_gae, skip_observation_gae

    kinds = [kind for kind, text in DEMO_SPANS for _ in text]
    span_of = [i for i, (_, text) in enumerate(DEMO_SPANS) for _ in text]
    action_mask = np.array([k == "action" for k in kinds])
    num_tokens = len(kinds)
    rewards = np.zeros(num_tokens, np.float32)
    rewards[-1] = 1.0  # outcome reward on the last action token
    # A tool-format bonus the environment puts on the first observation: credited, never dropped.
    first_obs = kinds.index("observation")
    rewards[first_obs] = 0.1
    # A critic that grows more confident as the episode goes on, and jumps when a tool answers.
    values = np.linspace(0.2, 0.8, num_tokens).astype(np.float32)
    values[np.array(kinds) == "observation"] += 0.3

    batch = lambda x: jnp.asarray(x)[None]  # noqa: E731
    skip_adv, _ = skip_observation_gae(
        batch(rewards), batch(values), batch(action_mask), gamma=gamma, lam=lam
    )
    cross_adv, _ = cross_observation_gae(
        batch(rewards), batch(values), batch(action_mask), batch(np.ones(num_tokens, bool)),
        gamma=gamma, lam=lam,
    )
    skip_adv, cross_adv = np.asarray(skip_adv[0]), np.asarray(cross_adv[0])

    lines = [
        f"GAE on one calculator-tool trajectory (γ={gamma}, λ={lam}); advantages are used on action spans only",
        "",
        "| span | kind | text | reward | mean V | mean A skip-obs | mean A cross-obs |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for i, (kind, text) in enumerate(DEMO_SPANS):
        sel = np.array(span_of) == i
        used = kind == "action"
        fmt = lambda a: f"{a[sel].mean():+.4f}" if used else "—"  # noqa: E731
        lines.append(
            f"| {i} | {kind} | `{text}` | {rewards[sel].sum():.2f} | {values[sel].mean():.3f} | "
            f"{fmt(skip_adv)} | {fmt(cross_adv)} |"
        )
    summary = {"skip_obs_total": float(skip_adv.sum()), "cross_obs_total": float(cross_adv[action_mask].sum())}
    lines += ["", "sum of action-token advantages: " + json.dumps(summary)]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
