"""The command line: a user's mistake is one `error:` line and exit 2 before any work; the GAE demo."""

import os
import subprocess
import sys

import pytest

from sao_jax.cli import evaluate_main, main
from sao_jax.config import ConfigError

# Each case: (files to write under tmp_path {name: text}, arguments with {tmp} for tmp_path, the words
# the one error line must hold). Runs stop at the first mistake, so the rest of each command is valid.
BAD_INPUTS = {
    "yaml syntax error": ({"bad.yaml": "train:\n  steps: 3\n   eval_every: [1\n"},
                          ["--config", "{tmp}/bad.yaml"], ["not valid YAML", "line 3", "bad.yaml"]),
    "config file missing": ({}, ["--config", "{tmp}/none.yaml"], ["not found", "none.yaml"]),
    "override value not yaml": ({}, ["train.steps=[1,"], ["train.steps=[1,", "not valid YAML"]),
    "unknown key": ({}, ["critic.updates_per_polcy_update=1"],
                    ["critic.updates_per_polcy_update", "did you mean critic.updates_per_policy_update"]),
    "unknown env.name": ({}, ["env.name=calculater"], ["env.name", "did you mean calculator"]),
    "unknown model.preset": ({}, ["model.preset=cpu_mo"], ["model.preset", "did you mean cpu_moe"]),
    "unknown estimator": ({}, ["advantage.estimator=skip_obs_gae"], ["advantage.estimator", "skip_observation_gae"]),
    "negative lr": ({}, ["policy.optimizer.lr=-1e-4"], ["policy.optimizer.lr", "> 0"]),
    "negative train.steps": ({}, ["train.steps=-3"], ["train.steps", ">= 0"]),
    "negative sft.steps": ({}, ["sft.steps=-5"], ["sft.steps", ">= 0"]),
    "negative sft.batch_size": ({}, ["sft.batch_size=-4"], ["sft.batch_size", ">= 1"]),
    "negative eps_low": ({}, ["loss.eps_low=-1"], ["loss.eps_low", "[0, 1]"]),
    "no eval prompts": ({}, ["env.eval_prompts=0"], ["env.eval_prompts", ">= 1"]),
    "zero temperature": ({}, ["rollout.temperature=0"], ["rollout.temperature", "> 0"]),
    "unknown rollout.decode_backend": ({}, ["rollout.decode_backend=native"],
                                       ["rollout.decode_backend must be one of auto, xla, native_cpu", "'native'"]),
    "pretrained folder missing": ({}, ["model.pretrained={tmp}/no_model"], ["no such folder", "no_model"]),
    "pretrained config.json not json": (
        {"model/config.json": "{not json", "model/tokenizer.json": "", "model/tokenizer_config.json": "{}"},
        ["model.pretrained={tmp}/model"], ["config.json is not valid JSON", "model/config.json"]),
    "train_file missing": ({}, ["env.train_file={tmp}/none.jsonl"], ["none.jsonl", "no such file", "env.train_file"]),
    "train_file malformed": ({"bad.jsonl": '{"prompt": "Q", "answer": "1"}\n{"prompt": \n'},
                             ["env.train_file={tmp}/bad.jsonl"], ["bad.jsonl, line 2", "not valid JSON", "env.train_file"]),
    "train_file empty": ({"empty.jsonl": "\n"}, ["env.train_file={tmp}/empty.jsonl"],
                         ["empty.jsonl", "no prompts", "env.train_file"]),
    "eval_file malformed": ({"bad.jsonl": '{"answer": "1"}\n'}, ["env.eval_file={tmp}/bad.jsonl"],
                            ["bad.jsonl, line 1", "prompt", "env.eval_file"]),
    "eval_file prompt too long": ({"long.jsonl": '{"prompt": "Q: 1+2=?", "answer": "3"}\n' * 2},
                                  ["env.eval_file={tmp}/long.jsonl", "rollout.max_total_tokens=8"],
                                  ["long.jsonl, line 1", "the prompt takes 9 tokens", "rollout.max_total_tokens=8",
                                   "env.eval_file"]),
    "train_file demonstration too long": (
        {"long.jsonl": '{"prompt": "Q: 1+2=?", "answer": "3", "expression": "1+2"}\n'},
        ["env.train_file={tmp}/long.jsonl", "rollout.max_total_tokens=16", "sft.steps=5"],
        ["long.jsonl, line 1", "SFT demonstration takes", "rollout.max_total_tokens=16", "env.train_file"]),
    "unknown env.bad_prompts": ({}, ["env.bad_prompts=ignore"], ["env.bad_prompts must be error or skip", "'ignore'"]),
    "output folder not writable": ({"file": "a file, not a folder"}, ["output_dir={tmp}/file/run"],
                                   ["cannot write the folder", "file/run", "output_dir"]),
    "checkpoint folder not writable": ({"file": ""}, ["train.checkpoint_dir={tmp}/file/ckpt"],
                                       ["cannot write the folder", "file/ckpt", "train.checkpoint_dir"]),
    "env option the environment refuses": ({}, ["env.name=topic_style_shift", "env.options.detail_rates=[0.5]"],
                                           ["env.options", "topic_style_shift", "detail_rates", "4 probabilities"]),
    "env option the environment does not take": ({}, ["env.name=style_shift", "env.options.colour=3"],
                                                 ["env.options", "style_shift", "colour"]),
}  # fmt: skip


def write_files(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_users_mistake_is_one_error_line_and_exit_2_before_any_work(case, tmp_path, capsys):
    files, args, words = BAD_INPUTS[case]
    write_files(tmp_path, files)
    out = tmp_path / "out"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    # A short tiny run, in case a mistake went unnoticed; the case's own arguments come last and win.
    tiny = [f"output_dir={out}", "model.preset=tiny_qwen3_moe", "sft.steps=0", "critic.pretrain_rollouts=0",
            "train.steps=0", "env.eval_prompts=1"]  # fmt: skip
    assert main([*tiny, *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, (word, err)
    assert not out.exists() or not any(out.iterdir())  # nothing written: no work was done


def test_sao_eval_reports_a_users_mistake_the_same_way(tmp_path, capsys):
    assert evaluate_main(["train.mode=asynch"]) == 2
    assert capsys.readouterr().err.strip() == "error: train.mode must be sync or async (got 'asynch') in <defaults> with command-line overrides"
    assert evaluate_main([f"model.pretrained={tmp_path}/none", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "no such folder" in err and f"{tmp_path}/none" in err


def test_debug_shows_the_traceback_of_a_users_mistake():
    with pytest.raises(ConfigError, match="train.steps must be >= 0"):
        main(["--debug", "train.steps=-3"])


def test_the_installed_command_prints_only_the_error_line(tmp_path):
    """The real entry point, in a process of its own: no warning or log line joins the error line."""
    (tmp_path / "bad.yaml").write_text("seed: [1\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "sao_jax.cli", "--config", str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: not valid YAML"), done.stderr
    assert str(tmp_path / "bad.yaml") in done.stderr and done.stdout == ""


def test_gae_demo_prints_both_estimators(capsys):
    assert main(["--gae-demo"]) == 0
    out = capsys.readouterr().out
    assert "mean A skip-obs" in out and "mean A cross-obs" in out
    assert out.count("| action |") == 3 and out.count("| observation |") == 2


def test_resume_flags_reach_train_and_a_resume_error_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    import sao_jax.train.loop as loop
    from sao_jax.checkpoint import ResumeError

    calls = []

    def refuse(config, **flags):
        calls.append(flags)
        raise ResumeError(f"no readable checkpoint in {tmp_path} (step 3: the array state.step does not match its digest)")

    monkeypatch.setattr(loop, "train", refuse)
    assert main([f"output_dir={tmp_path}", "--resume", "--allow-config-change"]) == 2
    assert main([f"output_dir={tmp_path}"]) == 2
    assert calls == [{"resume": True, "allow_config_change": True}, {"resume": False, "allow_config_change": False}]
    err = capsys.readouterr().err
    assert err == f"error: no readable checkpoint in {tmp_path} (step 3: the array state.step does not match its digest)\n" * 2


def test_the_entry_point_sets_the_ragged_dot_triton_flag_from_the_config(capsys):
    """`model.ragged_dot_triton` reaches JAX's config through `sao-train` (here its `--gae-demo` path,
    which loads the config and stops), and its default leaves the flag off."""
    import jax

    flag = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
    try:
        assert main(["--gae-demo", "model.ragged_dot_triton=true"]) == 0
        assert jax.config.values[flag] is True
        assert main(["--gae-demo"]) == 0
        assert jax.config.values[flag] is False
    finally:
        jax.config.update(flag, False)
    capsys.readouterr()


@pytest.mark.parametrize("xla_flags", [None, "--xla_backend_optimization_level=0"], ids=["unset", "set"])
def test_importing_the_library_changes_no_environment_variable_or_jax_flag(xla_flags):
    """Neither XLA_FLAGS (unset, or set without the entry points' scheduler option) nor any other
    variable or JAX flag changes when the package and its modules are imported."""
    program = (
        "import os, jax; env, flags = dict(os.environ), dict(jax.config.values)\n"
        "import sao_jax, sao_jax.models, sao_jax.models.moe, sao_jax.native.decode, sao_jax.rollout.sampler\n"
        "import sao_jax.cli, sao_jax.train.loop\n"
        "changed = {k for k in set(flags) | set(jax.config.values) if flags.get(k) != jax.config.values.get(k)}\n"
        "assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items())\n"
        "assert not changed, changed\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | ({} if xla_flags is None else {"XLA_FLAGS": xla_flags})
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, check=False,
                            env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_entry_point_sets_the_cpu_scheduler_flag_unless_xla_flags_names_it(capsys, monkeypatch):
    """`sao-train` (its `--gae-demo` path, which loads the config and stops) adds the XLA:CPU scheduler
    option to XLA_FLAGS, keeping what was there; a value the user gave the option is left alone."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert main(["--gae-demo"]) == 0
    assert os.environ["XLA_FLAGS"] == ("--xla_backend_optimization_level=0 "
                                       "--xla_cpu_enable_concurrency_optimized_scheduler=false")  # fmt: skip
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    assert main(["--gae-demo"]) == 0
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.delenv("XLA_FLAGS")
    assert main(["--gae-demo"]) == 0
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    capsys.readouterr()


def test_a_stop_on_a_signal_and_a_failed_save_are_one_line_each_with_their_exit_status(capsys, monkeypatch, tmp_path):
    import signal

    import sao_jax.train.loop as loop
    from sao_jax.checkpoint import CheckpointSaveError
    from sao_jax.train.signals import Interrupted

    outcomes = iter([Interrupted(signal.SIGTERM, 7), Interrupted(signal.SIGINT, None, "SFT"),
                     Interrupted(signal.SIGTERM, 3, dropped_prompts=5),
                     CheckpointSaveError(4, tmp_path, "No space left on device")])  # fmt: skip

    def stop(config, **flags):
        raise next(outcomes)

    monkeypatch.setattr(loop, "train", stop)
    assert [main([f"output_dir={tmp_path}"]) for _ in range(4)] == [143, 130, 143, 1]
    assert capsys.readouterr().err.splitlines() == [
        "interrupted by SIGTERM at step 7; saved; resume with --resume",
        "interrupted by SIGINT during SFT, before the first checkpoint; --resume starts from the beginning",
        "interrupted by SIGTERM at step 3; saved; 5 prompts queued or in flight dropped; resume with --resume",
        f"error: checkpoint step 4 could not be saved in {tmp_path}: No space left on device (the earlier checkpoints "
        "are kept: --resume continues from the newest)"]  # fmt: skip
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "143 after\nSIGTERM, 130 after SIGINT" in capsys.readouterr().out
