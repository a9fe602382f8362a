"""What a run writes: `metrics.jsonl`, TensorBoard events, and `plots/*.png` at the end; optionally
the same scalars to Weights & Biases (`train.wandb`).

`metrics.jsonl` holds one JSON object per line, each with an integer `"step"`; evaluation lines carry
`"eval/success_rate"`. Lines are flushed as they are written, so a crash loses at most the line being
written; on resume, lines past the checkpoint's step are cut away first (`truncate_after`) so the
resumed run appends exactly what the uninterrupted run would have. TensorBoard events are flushed at
every checkpoint (`flush`), and a resumed writer purges the events after the checkpoint's step
(`purge_step`: TensorBoard drops the older events from that step on), so the curves match
`metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    """A JSON-ready scalar: numpy/JAX scalars to Python numbers, NaN/inf to None (strict JSON)."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    number = float(np.asarray(value))
    if not math.isfinite(number):
        return None
    if isinstance(value, (int, np.integer)) or (np.asarray(value).dtype.kind in "iu"):
        return int(number)
    return number


def _scalars(line: Mapping[str, Any]) -> dict[str, int | float]:
    """The numeric entries of a written line, less `step`: what TensorBoard and W&B chart."""
    return {k: v for k, v in line.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip


class MetricsWriter:
    """Appends metric lines to `OUTDIR/metrics.jsonl` and mirrors their scalars to TensorBoard and,
    when `wandb_project` is set, to a Weights & Biases run (`config` is that run's config).
    `purge_step`: on resume, the first step written again."""

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: Mapping[str, Any] | None = None, purge_step: int | None = None):  # fmt: skip
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = _start_wandb(wandb_project, self.output_dir, config) if wandb_project is not None else None
        self.path = self.output_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = _TensorBoard(self.output_dir / "tensorboard", purge_step) if tensorboard else None

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write one line `{"step": step, **metrics}`; returns the line as written."""
        line = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(line, sort_keys=True) + "\n")
        self._file.flush()
        scalars = _scalars(line)
        if self._tb is not None:
            self._tb.write(int(step), scalars)
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))
        return line

    def flush(self) -> None:
        """Put every TensorBoard event written so far on disk (the metric lines always are)."""
        if self._tb is not None:
            self._tb.events.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.events.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TensorBoard:
    """One event file of `folder`, written in the caller's thread (tensorboardX's `SummaryWriter`
    queues events for a thread of its own, so its flush can miss some), named
    `events.out.tfevents.<time>.<host>.<pid>`. `purge_step`: a SessionLog START at that step first."""

    def __init__(self, folder: Path, purge_step: int | None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        folder.mkdir(parents=True, exist_ok=True)
        self.events = EventsWriter(str(folder / "events"), f".{os.getpid()}")
        if purge_step is not None:
            self.events.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in scalars.items()]
        self.events.write_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))


def _start_wandb(project: str, output_dir: Path, config: Mapping[str, Any] | None):
    """A W&B run named after the output folder; wandb is imported only here (it is optional). A
    resumed training run starts a new W&B run (ours): its lines begin at the checkpoint's step."""
    try:
        import wandb
    except ImportError:
        raise ImportError("train.wandb is true but wandb is not installed: pip install wandb") from None
    return wandb.init(project=project, name=output_dir.name, dir=str(output_dir), config=dict(config or {}))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete lines of a metrics file (a torn last line from a crash is ignored)."""
    lines = []
    for text in Path(path).read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            break  # only the last line can be torn: it was being written when the process died
    return lines


def truncate_after(path: str | Path, step: int) -> int:
    """Keep the lines with `step <= step` (and drop a torn tail); returns how many lines were cut."""
    path = Path(path)
    if not path.exists():
        return 0
    before = len(path.read_text().splitlines())
    kept = [line for line in read_metrics(path) if line["step"] <= step]
    path.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in kept))
    return before - len(kept)


# Which metrics each plot shows: (file name, title, panels). A panel is (metrics, label), its metrics
# one key, a tuple of keys (one line each), or a prefix ending in "/" (every key under it, one line
# each; the gradient norms' on a log scale: the module groups span decades).
PLOTS: tuple[tuple[str, str, tuple[tuple[str | tuple[str, ...], str], ...]], ...] = (
    ("reward.png", "Reward and held-out success",
     (("train/reward_mean", "train reward"), ("eval/success_rate", "held-out success"),
      ("eval/success_rate/", "held-out success per difficulty level"))),
    ("critic.png", "Critic", (("critic/value_loss", "value loss"),
                              (("critic/before_updates/explained_variance", "critic/after_updates/explained_variance"),
                               "explained variance before / after its K updates"))),
    ("grad_norms.png", "Gradient norms by module group, before clipping",
     (("critic/grad_norm/", "critic"), ("policy/grad_norm/", "policy"))),
    ("advantage.png", "Advantage over action tokens",
     ((("policy/advantage_first_action_token", "policy/advantage_last_action_token", "policy/advantage_mean"),
       "mean: first token of each action, last token, every action token"), ("policy/advantage_std", "spread"),
      (("advantage/window_fill", "advantage/window_empty"),
       "running-mean window: earlier rewards it holds; share of empty windows (baseline 0)"))),
    ("keep_rule.png", "Keep rule, and the training-inference mismatch on lag-0 tokens",
     ((("policy/masked_fraction", "mismatch/masked_fraction"), "masked fraction: all action tokens, lag-0 ones"),
      ("policy/masked_entropy_mean", "masked-token entropy"),
      (("mismatch/logprob_abs_mean", "mismatch/logprob_abs_max"), "|log μ − log π_θ|, lag-0 tokens: mean, max"))),
    ("tools.png", "Tool choice (calculator: the estimator is the weak demonstrator's tool)",
     (("train/tool_share/est", "estimator share, train"), ("eval/tool_share/est", "estimator share, held-out"))),
    ("advantage_probe.png", "Advantage quality: the estimator's advantage at each decision against Monte-Carlo Q − V",
     (("probe/advantage_correlation", "correlation"), (("probe/advantage_rmse", "probe/mc_advantage_std"),
                                                        "RMSE, and the spread of the Monte-Carlo advantages"))),
    ("staleness.png", "Asynchrony, or sync mode's policy lag",
     (("async/staleness_mean", "mean staleness"), ("async/queue_depth", "queue depth"))),
    ("styles.png", "Online experiment: the style written, its first-action advantage, the quality check",
     (("train/style_share/", "share of each style (train)"),
      ("train/first_action_advantage/", "advantage at the first action token, by the style written"),
      ("train/quality_rate/", "quality check met, per level (train)"),
      ("eval/quality_rate/", "quality check met, per level (held-out)"))),
)  # fmt: skip
# The online experiment logs the rewarded style per RL step: every plot marks its switches (dashed).
TARGET_STYLE_KEY = "train/target_style"


def style_switches(lines: list[Mapping[str, Any]]) -> list[int]:
    """The steps at which `train/target_style` differs from the step logged before."""
    logged = sorted((line["step"], line[TARGET_STYLE_KEY]) for line in lines if line.get(TARGET_STYLE_KEY) is not None)
    return [step for (step, style), (_, before) in zip(logged[1:], logged) if style != before]


def _panel_keys(metrics: str | tuple[str, ...], lines: list[Mapping[str, Any]]) -> list[str]:
    """The keys a panel draws that occur in `lines`, in a stable order."""
    if isinstance(metrics, str) and metrics.endswith("/"):
        keys = sorted({key for line in lines for key in line if key.startswith(metrics)})
    else:
        keys = [metrics] if isinstance(metrics, str) else list(metrics)
    return [key for key in keys if any(line.get(key) is not None for line in lines)]


def legend_labels(keys: list[str]) -> list[str]:
    """Short legend labels for one panel's keys: the "/"-separated components in which they differ
    (`critic/before_updates/explained_variance`, `critic/after_updates/explained_variance` ->
    `before_updates`, `after_updates`)."""
    parts = [key.split("/") for key in keys]
    head = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    return ["/".join(p[head:len(p) - tail]) for p in parts]


def plot_run(output_dir: str | Path, lines: Iterable[Mapping[str, Any]] | None = None) -> list[Path]:
    """Write `plots/*.png` from a run's metrics; a plot whose metrics never appeared is skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    lines = list(lines) if lines is not None else read_metrics(output_dir / "metrics.jsonl")
    (output_dir / "plots").mkdir(parents=True, exist_ok=True)
    switches = style_switches(lines)
    written = []
    for filename, title, panels in PLOTS:
        present = [(keys, metrics, label) for metrics, label in panels if (keys := _panel_keys(metrics, lines))]
        if not present:
            continue
        fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.5), squeeze=False)
        for ax, (keys, metrics, label) in zip(axes[0], present):
            for key, legend in zip(keys, legend_labels(keys)):
                points = [(line["step"], line[key]) for line in lines if line.get(key) is not None]
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3,
                        label=legend if len(keys) > 1 else None)  # fmt: skip
            for step in switches:
                ax.axvline(step, color="k", linestyle="--", linewidth=0.6, alpha=0.6)
            if isinstance(metrics, str) and metrics.endswith("grad_norm/"):
                ax.set_yscale("symlog", linthresh=1e-6)  # a frozen group's norm is exactly 0
            if len(keys) > 1:
                ax.legend(fontsize=7)
            ax.set_title(label)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        path = output_dir / "plots" / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
