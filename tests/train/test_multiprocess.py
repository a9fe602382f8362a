"""`sao-train` as 2 local processes (`jax.distributed` on loopback, gloo CPU collectives, one CPU device
each), and as 1 process with 2 CPU devices, against the same run on 1 device with the same global batch."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.cli import main
from sao_jax.config import load_config
from sao_jax.models import Policy, sharding, tiny_qwen3_moe
from sao_jax.train import distributed
from sao_jax.train.distributed import Cluster, process_block
from sao_jax.train.build import build_run
from tests.xla_flags import xla_flags

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
# A stop that may take as long as a loaded CI machine needs: these tests check what is saved, not the bound
# (tests/train/test_signals.py does); a bound that expires in one process aborts the other at shutdown.
PATIENT_STOP = ("train.signal_grace_s=300",)
# SFT, value pretraining, the step-0 evaluation, two TTUR steps, a final evaluation, and a checkpoint
# after each of them.
TINY_RUN = [
    "model.preset=tiny_qwen3_moe", "env.train_prompts=16", "env.eval_prompts=4", "env.difficulty=[1]",
    "rollout.num_slots=4", "rollout.max_total_tokens=64", "rollout.max_action_tokens=16", "sft.steps=2",
    "sft.batch_size=4", "critic.pretrain_rollouts=4", "critic.pretrain_epochs=1", "critic.warmup_steps=0",
    "train.steps=2", "train.batch_size=4", "train.eval_every=2", "train.checkpoint_every=1",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(output_dir: Path, cache_dir: Path, *processes: str, devices: int = 1, overrides: tuple[str, ...] = (),
          output=subprocess.PIPE) -> subprocess.Popen:  # fmt: skip
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")  # fmt: skip
    command = [sys.executable, "-m", "sao_jax.cli", *processes, f"output_dir={output_dir}", *TINY_RUN, *overrides]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)


def finish(runs: list[subprocess.Popen]) -> list[str]:
    """Each run's output; a hang or a failure of any run fails the test with the outputs."""
    try:
        outputs = [run.communicate(timeout=TIMEOUT_S)[0] for run in runs]
    except subprocess.TimeoutExpired:
        for run in runs:
            run.kill()
        pytest.fail(f"sao-train did not finish within {TIMEOUT_S}s")
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, f"{run.args} exited with {run.returncode}:\n{output[-4000:]}"
    return outputs


def metric_lines(path: Path) -> list[dict]:
    """Every line of a metrics file less its wall-clock timings."""
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("time/")} for line in lines]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One persistent compilation cache for every run of this module: a program compiles once."""
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """(2-process output dir, 1-process output dir, outputs of processes 0 and 1, 1 process on 2 devices:
    (output dir, output), 2 processes of 2 devices with one kept for rollouts: (output dir, outputs))."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    # The reference first: the two processes then find its sampler programs in the compilation cache.
    finish([start(tmp / "one", cache)])
    port = free_port()
    outputs = finish([start(tmp / "two", cache, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                            "--process-id", str(i)) for i in range(2)])  # fmt: skip
    (two_devices,) = finish([start(tmp / "two_devices", cache, "mesh.fsdp=2", devices=2)])
    port = free_port()
    split = finish([start(tmp / "split", cache, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                          "--process-id", str(i), "mesh.rollout_devices=1", devices=2) for i in range(2)])  # fmt: skip
    return tmp / "two", tmp / "one", outputs, (tmp / "two_devices", two_devices), (tmp / "split", split)


@pytest.mark.slow
def test_both_processes_log_identical_metrics_and_only_process_0_writes_the_run_files(runs):
    two, _, outputs, _, _ = runs
    for i, output in enumerate(outputs):
        assert f"process {i} of 2: train state on the mesh data=1 fsdp=2 expert=1 tensor=1" in output
    lines = metric_lines(two / "metrics.jsonl")
    assert metric_lines(two / "process_1" / "metrics.jsonl") == lines
    assert list(dict.fromkeys(line.get("stage") for line in lines)) == ["sft", "value_pretrain", None]
    assert [line["step"] for line in lines if "eval/success_rate" in line] == [0, 2]
    assert [line["step"] for line in lines if "policy/loss" in line] == [1, 2]
    assert sorted(p.name for p in (two / "process_1").iterdir()) == ["metrics.jsonl"]
    assert {"config.yaml", "summary.json", "plots", "tensorboard"} <= {p.name for p in two.iterdir()}
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1, 2]


def assert_matches_one_device(got_dir: Path, one: Path) -> None:
    got, expected = metric_lines(got_dir / "metrics.jsonl"), metric_lines(one / "metrics.jsonl")
    assert [sorted(line) for line in got] == [sorted(line) for line in expected]
    inexact = set()
    for got_line, expected_line in zip(got, expected):
        for key, value in expected_line.items():
            if got_line[key] == value:
                continue
            inexact.add(key)
            # The sharded steps sum in another order than one device: float32 rounding only.
            assert isinstance(value, float), f"step {expected_line['step']} {key}: {got_line[key]!r} != {value!r}"
            np.testing.assert_allclose(got_line[key], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {expected_line['step']} {key}")  # fmt: skip
    # Rollouts sample the same tokens (each prompt's key is its global index): what they measure is exact.
    assert not {key for key in inexact if key.startswith(("train/", "eval/"))}, inexact


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_global_batch(runs):
    two, one, _, _, _ = runs
    assert_matches_one_device(two, one)


@pytest.mark.slow
def test_one_process_with_two_devices_puts_the_state_on_a_mesh_and_matches_one_device(runs):
    _, one, _, (two_devices, output), _ = runs
    assert "process 0 of 1: train state on the mesh data=1 fsdp=2 expert=1 tensor=1" in output
    assert_matches_one_device(two_devices, one)


@pytest.mark.slow
def test_two_processes_sampling_on_split_off_devices_match_one_device(runs):
    """`mesh.rollout_devices=1`, 2 processes of 2 devices: each trains on one device (the mesh spans
    one of each process) and samples on the other, with the weights copied across after every step."""
    _, one, _, _, (split, outputs) = runs
    for i, output in enumerate(outputs):
        assert (f"process {i} of 2: train state on the mesh data=1 fsdp=2 expert=1 tensor=1; "
                "rollouts on 1 other device(s) of each process") in output  # fmt: skip
    assert_matches_one_device(split, one)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, cache):
    """`train.mode=async` as 2 processes of 2 devices each, one of them kept for rollouts (sampling runs
    while the other trains): (output dir, outputs of processes 0 and 1)."""
    tmp = tmp_path_factory.mktemp("multiprocess_async")
    port = free_port()
    outputs = finish([start(tmp / "run", cache, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                            "2", "--process-id", str(i), "train.mode=async", "mesh.rollout_devices=1", devices=2)
                     for i in range(2)])  # fmt: skip
    return tmp / "run", outputs


@pytest.mark.slow
def test_two_processes_stream_rollouts_asynchronously_and_log_identical_metrics(async_run):
    run, outputs = async_run
    for i, output in enumerate(outputs):
        assert f"process {i} of 2: train state on the mesh data=1 fsdp=2 expert=1 tensor=1; rollouts on 1" in output
    lines = metric_lines(run / "metrics.jsonl")
    assert metric_lines(run / "process_1" / "metrics.jsonl") == lines
    rl = [line for line in lines if "policy/loss" in line]
    assert [line["step"] for line in rl] == [1, 2]
    for line in rl:  # each process streamed 2 of the batch's 4; the engines' counters are summed
        assert line["train/trajectories"] == 4
        assert line["async/trajectories_per_s"] > 0
        assert 0 <= line["async/staleness_mean"] <= 1
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1, 2]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_step_saved(tmp_path, cache):
    """Only process 1 gets SIGTERM: both finish the same step, save it together and exit 143, each
    with its one line (`StopRequests.agreed` gathers the processes' flags every step)."""
    out, port = tmp_path / "run", free_port()
    logs = [(tmp_path / f"process_{i}.log").open("w") for i in range(2)]  # a pipe nobody reads yet would fill
    runs = [start(out, cache, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                  overrides=("train.steps=8", "train.checkpoint_every=8", "train.eval_every=8", *PATIENT_STOP),
                  output=logs[i])
            for i in range(2)]  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    while not any(line.get("step") == 1 for line in read_lines(out / "process_1" / "metrics.jsonl")):
        assert all(run.poll() is None for run in runs) and time.monotonic() < deadline, "run did not reach step 1"
        time.sleep(0.02)
    runs[1].send_signal(signal.SIGTERM)
    try:
        for run in runs:
            run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        for run in runs:
            run.kill()
        pytest.fail("the processes did not stop within 120 s of SIGTERM")
    for log in logs:
        log.close()
    outputs = [(tmp_path / f"process_{i}.log").read_text() for i in range(2)]
    step = metric_lines(out / "metrics.jsonl")[-1]["step"]
    for run, output in zip(runs, outputs):
        assert run.returncode == 143 and "Traceback" not in output, output[-4000:]
        assert f"interrupted by SIGTERM at step {step}; saved; resume with --resume" in output.splitlines()
    assert 1 <= step < 8 and metric_lines(out / "process_1" / "metrics.jsonl") == metric_lines(out / "metrics.jsonl")
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [0, step]


def read_lines(path: Path) -> list[dict]:
    """The complete JSON lines of a metrics file being written (none while it does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def test_one_process_uses_all_its_accelerator_chips_but_not_its_fake_cpu_devices(monkeypatch):
    """The default mesh (fsdp: -1) spans every chip of a single TPU VM or GPU host; the 8 fake CPU
    devices of the tests train on the first unless the sizes are given."""
    config = load_config(None, ["train.batch_size=8"])
    assert Cluster.for_config(config).mesh is None
    assert Cluster.for_config(load_config(None, ["train.batch_size=8", "mesh.fsdp=8"])).mesh.shape["fsdp"] == 8
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    mesh = Cluster.for_config(config).mesh
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}


def test_the_samplers_replica_is_whole_and_spread_over_the_local_devices():
    """One process, 4 devices: every weight equal to the trained one; q heads (4) split over the
    4 devices, kv heads (2) whole on each, nothing sharded over the train mesh's fsdp."""
    mesh = sharding.make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    cluster = Cluster(mesh)
    state = nnx.state(Policy(tiny_qwen3_moe(), rngs=nnx.Rngs(0)))
    replica = dict(nnx.to_flat_state(cluster.local_replica(cluster.place(state))))
    for path, variable in nnx.to_flat_state(state):
        np.testing.assert_array_equal(replica[path].get_value(), variable.get_value(), err_msg=str(path))
    q = replica[("layers", 0, "attn", "q_proj", "kernel")].get_value()  # [embed 32, heads 4, head_dim 8]
    k = replica[("layers", 0, "attn", "k_proj", "kernel")].get_value()  # [embed 32, kv_heads 2, head_dim 8]
    assert q.sharding.mesh.devices.size == 4
    assert {shard.data.shape for shard in q.addressable_shards} == {(32, 1, 8)}
    assert {shard.data.shape for shard in k.addressable_shards} == {(32, 2, 8)}


def test_with_rollout_devices_split_off_the_replica_lives_on_them_and_the_mesh_on_the_rest(monkeypatch):
    """`mesh.rollout_devices=2` of 4 devices: the train mesh is devices 2-3, the sampler's replica
    whole on devices 0-1 (q heads split over them), copied in groups when the group limit is small."""
    config = load_config(None, ["mesh.rollout_devices=2", "train.batch_size=4"])
    devices = jax.devices()
    with pytest.raises(ValueError, match=r"mesh.rollout_devices=8 must be less than the 8 devices"):
        Cluster.for_config(load_config(None, ["mesh.rollout_devices=8"]))
    monkeypatch.setattr(jax, "devices", lambda: devices[:4])
    cluster = Cluster.for_config(config)
    assert set(cluster.mesh.devices.flat) == set(devices[2:4]) and cluster.rollout_devices == tuple(devices[:2])
    monkeypatch.setattr(distributed, "TRANSFER_GROUP_BYTES", 4096)  # several groups for the tiny model
    state = nnx.state(Policy(tiny_qwen3_moe(), rngs=nnx.Rngs(0)))
    replica = dict(nnx.to_flat_state(cluster.local_replica(cluster.place(state))))
    for path, variable in nnx.to_flat_state(state):
        value = replica[path].get_value()
        np.testing.assert_array_equal(value, variable.get_value(), err_msg=str(path))
        assert value.sharding.device_set == set(devices[:2]), path
    q = replica[("layers", 0, "attn", "q_proj", "kernel")].get_value()  # [embed 32, heads 4, head_dim 8]
    assert {shard.data.shape for shard in q.addressable_shards} == {(32, 2, 8)}
    sizes = [np.zeros(n, np.uint8) for n in (1000, 1000, 5000, 10, 3000)]
    assert distributed._byte_groups(sizes, 2500) == [[0, 1], [2], [3], [4]]
    assert distributed._byte_groups(sizes, None) == [[0, 1, 2, 3, 4]]


def test_a_preset_policy_on_a_mesh_is_drawn_in_shards_equal_to_the_host_build():
    """`build_run` with an explicit 8-device mesh draws each parameter in its shards on the devices
    (`sharding.sharded_init`) rather than on the host: the 1-device build's numbers, up to the last bit
    of a scaled normal sample (jit vs eager rounding; the sharded steps' sums differ as much)."""
    overrides = ["model.preset=tiny_qwen3_moe", "env.train_prompts=4", "env.eval_prompts=4"]
    host = nnx.to_flat_state(nnx.state(build_run(load_config(None, overrides)).policy))
    run = build_run(load_config(None, [*overrides, "mesh.fsdp=8"]))
    assert run.cluster.mesh is not None
    sharded = dict(nnx.to_flat_state(nnx.state(run.policy)))
    for path, variable in host:
        value = sharded[path].get_value()
        np.testing.assert_allclose(value, variable.get_value(), rtol=1e-6, atol=1e-9, err_msg=str(path))
        assert value.sharding.mesh.devices.size == 8, path
    embedding = sharded[("embed", "embedding")].get_value()  # [vocab, embed]: embed over fsdp
    assert len({shard.data.shape for shard in embedding.addressable_shards}) == 1
    assert embedding.addressable_shards[0].data.size * 8 == embedding.size


def test_process_blocks_cover_the_prompts_in_order():
    for n in range(12):
        for count in range(1, 5):
            blocks = [process_block(n, p, count) for p in range(count)]
            assert [i for block in blocks for i in block] == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_coordinator_without_process_count_and_id_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--coordinator", "127.0.0.1:1234", "train.steps=1"])
    assert exit_info.value.code == 2
    assert "--coordinator, --num-processes and --process-id go together" in capsys.readouterr().err
