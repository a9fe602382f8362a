"""metrics.jsonl, truncation on resume, TensorBoard events and plots."""

import json

import numpy as np

from sao_jax.metrics import MetricsWriter, plot_run, read_metrics, truncate_after


def test_lines_have_step_and_plain_json_values(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(0, {"eval/success_rate": np.float32(0.25), "count": np.int32(3), "bad": float("nan")})
        writer.write(1, {"train/reward_mean": 0.5})
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(raw[0])  # strict JSON: NaN became null
    assert first == {"step": 0, "eval/success_rate": 0.25, "count": 3, "bad": None}
    assert isinstance(first["count"], int)
    assert [line["step"] for line in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    assert list((tmp_path / "tensorboard").iterdir()), "no TensorBoard event file"


def test_torn_last_line_is_ignored_and_truncation_cuts_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in range(5):
            writer.write(step, {"x": step})
    with path.open("a") as f:
        f.write('{"step": 5, "x"')  # the process died mid-write
    assert [line["step"] for line in read_metrics(path)] == [0, 1, 2, 3, 4]
    assert truncate_after(path, 2) == 3  # lines 3, 4 and the torn one
    assert [line["step"] for line in read_metrics(path)] == [0, 1, 2]
    assert truncate_after(tmp_path / "absent.jsonl", 2) == 0


def test_plots_are_written_for_metrics_that_exist(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in range(4):
            writer.write(step, {"train/reward_mean": step / 4, "critic/value_loss": 1 / (step + 1)})
    written = {p.name for p in plot_run(tmp_path)}
    assert written == {"reward.png", "critic.png"}
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in written)
