"""metrics.jsonl, truncation on resume, TensorBoard events and plots."""

import json
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import metrics as metrics_lib
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


def tensorboard_curves(folder):
    """{tag: [(step, value)]} as TensorBoard shows it: event files in name order, and a SessionLog
    START at step p drops the events read before it whose step is >= p (TensorBoard's purge rule)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord: length (8 bytes), its CRC (4), the record, its CRC (4)
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            if event.session_log.status == SessionLog.START:
                events = [e for e in events if e[0] < event.step]
            events += [(event.step, value.tag, value.simple_value) for value in event.summary.value]
    curves = {}
    for step, tag, value in events:
        curves.setdefault(tag, []).append((step, value))
    return curves


def test_events_are_on_disk_after_flush_and_a_resumed_writer_supersedes_those_after_its_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(4):
        writer.write(step, {"loss": float(step)})
    writer.flush()  # the writer is left open, as a killed process leaves it
    assert tensorboard_curves(tmp_path / "tensorboard") == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]}
    time.sleep(1.1)  # event files are named by the second they were opened in
    with MetricsWriter(tmp_path, purge_step=3) as resumed:  # resumed from the checkpoint of step 2
        resumed.write(3, {"loss": 30.0})
    assert tensorboard_curves(tmp_path / "tensorboard") == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]}
    writer.close()


def _strict_json(text):
    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")

    return json.loads(text, parse_constant=refuse)


def test_infinities_are_written_as_null(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(0, {"up": float("inf"), "down": np.float32("-inf"), "nan": np.nan, "fine": 2.5})
    line = _strict_json((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line == {"step": 0, "up": None, "down": None, "nan": None, "fine": 2.5}


def test_zero_dimensional_integer_arrays_are_written_as_json_integers(tmp_path):
    # What jax.device_get hands back for a scalar: a 0-d numpy array, not an np.integer.
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(0, {"host": np.asarray(7, np.int32), "device": jnp.int32(5),
                         "fetched": jax.device_get(jnp.int32(4)), "unsigned": np.asarray(9, np.uint8),
                         "real": np.asarray(1.0, np.float32)})
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert raw == '{"device": 5, "fetched": 4, "host": 7, "real": 1.0, "step": 0, "unsigned": 9}'


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


def test_a_prefix_panel_draws_every_group_and_a_tuple_panel_each_key(tmp_path):
    lines = [{"step": s, "critic/grad_norm/attention": 0.0, "critic/grad_norm/experts": 2.0 ** -s,
              "critic/before_updates/explained_variance": 0.1 * s} for s in range(3)]  # fmt: skip
    written = {p.name for p in plot_run(tmp_path, lines)}
    assert written == {"grad_norms.png", "critic.png"}
    assert metrics_lib._panel_keys("critic/grad_norm/", lines) == ["critic/grad_norm/attention",
                                                                   "critic/grad_norm/experts"]  # fmt: skip
    assert metrics_lib._panel_keys(("critic/before_updates/explained_variance", "critic/after_updates/explained_variance"),
                                   lines) == ["critic/before_updates/explained_variance"]  # fmt: skip


def test_the_probe_and_per_level_success_have_plots_when_logged(tmp_path):
    lines = [{"step": s, "eval/success_rate": 0.5, "eval/success_rate/level_1": 0.8, "eval/success_rate/level_2": 0.2,
              "probe/advantage_correlation": 0.1 * s, "probe/advantage_rmse": 0.3, "probe/mc_advantage_std": 0.4}
             for s in range(3)]  # fmt: skip
    assert {p.name for p in plot_run(tmp_path, lines)} == {"reward.png", "advantage_probe.png"}
    assert metrics_lib._panel_keys("eval/success_rate/", lines) == ["eval/success_rate/level_1",
                                                                    "eval/success_rate/level_2"]  # fmt: skip


def test_legend_labels_keep_the_components_in_which_keys_differ():
    # The critic plot's two explained variances differ only in when they were measured.
    before, after = "critic/before_updates/explained_variance", "critic/after_updates/explained_variance"
    assert metrics_lib.legend_labels([before, after]) == ["before_updates", "after_updates"]
    assert metrics_lib.legend_labels(["advantage/window_fill", "advantage/window_empty"]) == ["window_fill",
                                                                                               "window_empty"]
    assert metrics_lib.legend_labels(["critic/grad_norm/attention", "critic/grad_norm/experts"]) == ["attention",
                                                                                                      "experts"]
    assert metrics_lib.legend_labels(["a/x", "b/y/z"]) == ["a/x", "b/y/z"]


def test_an_online_run_gets_its_style_plot_and_every_plot_knows_the_switches(tmp_path):
    targets = ["cute"] * 3 + ["classical"] * 3 + ["cute"] * 2
    lines = [{"step": s, "train/target_style": t, "train/style_share/cute": 0.5, "train/style_share/classical": 0.4,
              "train/first_action_advantage/cute": 0.1, "train/first_action_advantage/classical": None,
              "train/reward_mean": 0.2} for s, t in enumerate(targets, start=1)]  # fmt: skip
    assert metrics_lib.style_switches(lines) == [4, 7]
    assert {p.name for p in plot_run(tmp_path, lines)} == {"reward.png", "styles.png"}
    assert metrics_lib._panel_keys("train/first_action_advantage/", lines) == ["train/first_action_advantage/cute"]
