"""Seconds from SIGTERM to exit of `sao-train` in the middle of RL (a preemption's notice).

    python benchmarks/sigterm_stop.py                      # the embedded default, 3 runs
    python benchmarks/sigterm_stop.py --runs 1 model.preset=tiny_qwen3_moe   # overrides go to sao-train

Each run starts `sao-train` in a folder of its own (with `train.steps` of `--steps`), waits until
`metrics.jsonl` holds the RL step `--after-step`, so the next step has just begun, sends SIGTERM and
times the process until it exits: the rest of the step in hand, its save, the flush and the exit
(`train.signal_grace_s` bounds it). The runs share an SFT cache (`sft.cache_dir`), so only the first
pays for the warm start's SFT. Printed per run: the seconds, the exit status (143 expected), the
process's last stderr line, the checkpoints left and the RL step times before the signal.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def rl_lines(metrics: Path) -> list[dict]:
    """The RL step lines written so far (a line being written is left out)."""
    if not metrics.exists():
        return []
    lines = [json.loads(text) for text in metrics.read_text().splitlines() if text.endswith("}")]
    return [line for line in lines if line.get("step", 0) >= 1 and "time/step_s" in line]


def stop_once(out: Path, after_step: int, overrides: list[str]) -> dict:
    """Start `sao-train` in `out`, SIGTERM it once RL step `after_step` is written; what the stop took."""
    out.mkdir(parents=True)
    with open(out / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "sao_jax.cli", f"output_dir={out / 'run'}", *overrides],
                                   cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        while not any(line["step"] >= after_step for line in rl_lines(out / "run" / "metrics.jsonl")):
            if process.poll() is not None:
                sys.exit(f"sao-train ended (exit {process.returncode}) before RL step {after_step}: {out / 'stderr.txt'}")
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status = process.wait()
        seconds = time.monotonic() - sent
    last = [text for text in (out / "stderr.txt").read_text().splitlines() if text.strip()][-1:]
    checkpoints = sorted((p.name for p in (out / "run" / "checkpoints").iterdir()), key=lambda name: (len(name), name))
    return {"sigterm_to_exit_s": round(seconds, 2), "exit_status": status, "last_line": last,
            "checkpoints": checkpoints,
            "step_s": {line["step"]: round(line["time/step_s"], 2) for line in rl_lines(out / "run" / "metrics.jsonl")}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--after-step", type=int, default=2, help="SIGTERM once this RL step is written")
    parser.add_argument("--steps", type=int, default=20, help="train.steps of each run")
    parser.add_argument("--out", type=Path, default=None, help="the runs' folder (default: a temporary one)")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as temporary:
        out = args.out or Path(temporary)
        overrides = [f"train.steps={args.steps}", f"sft.cache_dir={out / 'sft_cache'}", *overrides]
        for run in range(args.runs):
            print(json.dumps(stop_once(out / f"run{run}", args.after_step, overrides)), flush=True)


if __name__ == "__main__":
    main()
