"""A URL `output_dir` (fsspec's in-memory filesystem standing in for gs://): the run's files reach the
URL, and a resume on a machine without the local mirror appends to the metrics at the URL."""

import json
import os
import shutil

import fsspec
import pytest

from sao_jax.config import load_config
from sao_jax.outputs import OutputMirror, join
from sao_jax.train.loop import train

from .test_multiprocess import TINY_RUN

URL = "memory://bucket/runs/tiny"


def remote_lines(fs, name="metrics.jsonl"):
    return [json.loads(line) for line in fs.cat(f"/bucket/runs/tiny/{name}").decode().splitlines()]


def test_join_keeps_a_urls_double_slash(tmp_path):
    assert join("gs://bucket/run/", "checkpoints") == "gs://bucket/run/checkpoints"
    assert join(tmp_path, "checkpoints") == str(tmp_path / "checkpoints")


def test_push_copies_only_what_changed():
    mirror = OutputMirror.fresh("memory://bucket/push")
    (mirror.local / "plots").mkdir()
    (mirror.local / "plots" / "a.png").write_bytes(b"1")
    (mirror.local / "metrics.jsonl").write_text("{}\n")
    assert mirror.push() == ["metrics.jsonl", "plots/a.png"]
    assert mirror.push() == []
    (mirror.local / "metrics.jsonl").write_text("{}\n{}\n")
    assert mirror.push() == ["metrics.jsonl"]
    assert fsspec.filesystem("memory").cat("/bucket/push/metrics.jsonl") == b"{}\n{}\n"


def test_pull_fetches_a_file_the_url_has_and_reports_one_it_lacks():
    fsspec.filesystem("memory").pipe("/bucket/pull/process_1/metrics.jsonl", b'{"step": 0}\n')
    mirror = OutputMirror.fresh("memory://bucket/pull", process_index=1)
    assert mirror.pull(mirror.local / "process_1" / "metrics.jsonl")
    assert (mirror.local / "process_1" / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert not mirror.pull(mirror.local / "metrics.jsonl")
    assert not (mirror.local / "metrics.jsonl").exists()


def test_push_copies_a_same_size_rewrite_with_a_new_mtime():
    mirror = OutputMirror.fresh("memory://bucket/same_size")
    path = mirror.local / "summary.json"
    path.write_text("{}\n")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert mirror.push() == ["summary.json"]
    path.write_text("[]\n")
    os.utime(path, ns=(2_000_000_000, 2_000_000_000))
    assert mirror.push() == ["summary.json"]
    assert fsspec.filesystem("memory").cat("/bucket/same_size/summary.json") == b"[]\n"


def test_fresh_mirrors_are_per_process_and_start_empty():
    first = OutputMirror.fresh("memory://bucket/fresh", process_index=0)
    (first.local / "stale.txt").write_text("left over")
    assert not any(OutputMirror.fresh("memory://bucket/fresh/", process_index=0).local.iterdir())
    assert OutputMirror.fresh("memory://bucket/fresh", process_index=1).local != first.local


@pytest.mark.slow
def test_a_run_writes_to_the_url_and_resumes_from_it_on_a_fresh_machine(tmp_path):
    fs = fsspec.filesystem("memory")
    # Orbax reaches a URL through etils.epath, which has no in-memory filesystem: checkpoints stay local.
    overrides = [*TINY_RUN, "sft.steps=0", "critic.pretrain_rollouts=0",  # what is written, not what is learnt
                 f"output_dir={URL}", f"train.checkpoint_dir={tmp_path / 'checkpoints'}"]  # fmt: skip
    train(load_config(None, [*overrides, "train.steps=1"]))
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "plots/reward.png"):
        assert fs.exists(f"/bucket/runs/tiny/{name}"), name
    assert fs.glob("/bucket/runs/tiny/tensorboard/events.out.tfevents.*")
    first = remote_lines(fs)
    assert [line["step"] for line in first if "policy/loss" in line] == [1]
    # Step 1 is the run's last though not a multiple of train.eval_every=2: it is evaluated all the same.
    assert [line["step"] for line in first if "eval/success_rate" in line] == [0, 1]

    shutil.rmtree(OutputMirror.fresh(URL).local)  # the preempted machine's disk is gone
    train(load_config(None, [*overrides, "train.steps=2"]), resume=True)
    resumed = remote_lines(fs)
    assert resumed[: len(first)] == first  # pulled back and appended to, not started over
    assert [line["step"] for line in resumed if "policy/loss" in line] == [1, 2]
