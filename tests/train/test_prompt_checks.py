"""Prompt files are checked against the run before any work: a character the tokenizer lacks, a
prompt that leaves no room for an action within `rollout.max_total_tokens`, or one whose SFT
demonstration is longer than that, is one line naming the file, the line (and column) and the key, and
`sao-train` exits 2 at once, not after minutes of SFT; under `env.bad_prompts=skip` such prompts (and
malformed lines) are left out and counted instead."""

import json
import logging
import subprocess
import sys
import time

import pytest

from sao_jax.cli import main
from sao_jax.config import load_config
from sao_jax.data.datasets import DatasetError
from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import environment_class
from sao_jax.envs.base import Prompt
from sao_jax.train.build import build_run, check_prompt
from tests.train.test_faults import messages
from tests.train.test_resume import environment

BASE = ["model.preset=tiny_qwen3_moe", "rollout.max_total_tokens=64", "env.train_prompts=8", "env.eval_prompts=4"]
LONG = "Q: " + "+".join(["1"] * 40) + "=?"  # 83 characters: 85 tokens with <bos> and the line end the calculator adds
# A prompt that fits in 64 tokens, but its demonstration does not (77 tokens: test_check_prompt_measures_...).
LONG_DEMONSTRATION = "Q: " + "+".join(["1"] * 10) + "=?"


def calculator_record(text):
    """A calculator prompt record `Q: EXPR=?` with the expression its demonstrations call the tool on."""
    expression = text.removeprefix("Q: ").split("=?")[0]
    return {"prompt": text, "answer": "1", "expression": expression}


def write(path, prompts):
    path.write_text("".join(json.dumps(calculator_record(p)) + "\n" for p in prompts))
    return str(path)


def check(prompt_text, line=None, *overrides, demonstrated=False):
    config = load_config(None, [*BASE, *overrides])
    prompt = Prompt(id=0, text=prompt_text, answer="1", difficulty=1, metadata=calculator_record(prompt_text))
    return check_prompt(config, environment_class(config.env.name), CharTokenizer(), None, prompt, line,
                        demonstrated=demonstrated)  # fmt: skip


def test_check_prompt_names_the_character_its_column_and_the_length_key():
    assert check("Q: 1+2=?") is None
    line = json.dumps({"prompt": "Q: 1+2=? — fast", "answer": "3"})  # written escaped: \u2014
    assert check("Q: 1+2=? — fast", line) == "character '—' at column 22 is not in the tokenizer's vocabulary"
    line = json.dumps({"prompt": "Q: été", "answer": "3"}, ensure_ascii=False)
    assert check("Q: été", line) == "character 'é' at column 16 is not in the tokenizer's vocabulary"
    assert check(LONG) == ("the prompt takes 85 tokens, leaving no room for an action within "
                           "rollout.max_total_tokens=64: shorten it or raise rollout.max_total_tokens")  # fmt: skip
    assert check(LONG, None, "rollout.max_total_tokens=96") is None


@pytest.mark.parametrize("key", ["env.train_file", "env.eval_file"])
def test_build_run_refuses_a_file_prompt_the_run_cannot_roll_out(tmp_path, key):
    path = write(tmp_path / "p.jsonl", ["Q: 1+2=?", "Q: 2+2=?", LONG])
    with pytest.raises(DatasetError, match=rf"^{path}, line 3: the prompt takes 85 tokens, .*\({key}\)$"):
        build_run(load_config(None, [*BASE, f"{key}={path}"]))
    path = write(tmp_path / "q.jsonl", ["Q: 1+2=?", "Q: 1+2=? naïve"])
    with pytest.raises(DatasetError, match=rf"^{path}, line 2: character 'ï' at column .*\({key}\)$"):
        build_run(load_config(None, [*BASE, f"{key}={path}"]))


def test_sao_train_with_an_unusable_prompt_file_exits_2_in_one_line_before_any_work(tmp_path):
    path = write(tmp_path / "train.jsonl", ["Q: 1+2=?", LONG])
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "sao_jax.cli", f"output_dir={tmp_path / 'run'}", *BASE,
                           f"env.train_file={path}"], env=environment(tmp_path / "jax_cache"), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert messages(done.stderr) == [f"error: {path}, line 2: the prompt takes 85 tokens, leaving no room for an "
                                     "action within rollout.max_total_tokens=64: shorten it or raise "
                                     "rollout.max_total_tokens (env.train_file)"]  # fmt: skip
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert time.monotonic() - started < 120  # no SFT ran


def test_check_prompt_measures_the_sft_demonstrations_of_a_prompt_sft_trains_on():
    # Counted by hand, one token a character: <bos>, the prompt, the call, the tool's answer, the final
    # answer (the file's "1"; the weaker demonstrator's call and estimate of 10 are as long).
    tokens = 1 + len(LONG_DEMONSTRATION) + len("<calc>1+1+1+1+1+1+1+1+1+1</calc>\n") + len("<out>10</out>\n") \
        + len("A: 1\n")
    assert check(LONG_DEMONSTRATION) is None  # a rollout may be cut at 64 tokens; a demonstration may not
    assert check(LONG_DEMONSTRATION, None, demonstrated=True) == (
        f"its SFT demonstration takes {tokens} tokens, more than rollout.max_total_tokens=64 (SFT's longest "
        "sequence): shorten the prompt or raise rollout.max_total_tokens")  # fmt: skip
    assert check(LONG_DEMONSTRATION, None, f"rollout.max_total_tokens={tokens}", demonstrated=True) is None
    config = load_config(None, BASE)
    bare = Prompt(id=0, text="Q: 1+2=?", answer="3", difficulty=1)  # no expression for the demonstrator to call
    assert check_prompt(config, environment_class("calculator"), CharTokenizer(), None, bare, demonstrated=True) == (
        "the environment 'calculator' cannot step through this prompt's SFT demonstration (KeyError: 'expression'); "
        "set sft.steps=0 to train without SFT")  # fmt: skip


@pytest.mark.parametrize("key", ["env.train_file", "env.eval_file"])
def test_sao_train_refuses_a_prompt_whose_sft_demonstration_is_too_long_before_any_work(tmp_path, capsys, key):
    """SFT trains on every training prompt and probes the first `sft.probe_prompts` held-out ones; a held-out
    prompt past those is only rolled out, where a long episode is cut, not refused."""
    path = write(tmp_path / "p.jsonl", ["Q: 1+2=?", LONG_DEMONSTRATION])
    out = tmp_path / "run"
    args = [f"output_dir={out}", *BASE, "sft.steps=4", "sft.check_every=2", "sft.probe_prompts=2", f"{key}={path}"]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"error: {path}, line 2: its SFT demonstration takes 77 tokens, more than rollout.max_total_tokens=64 (SFT's "
         f"longest sequence): shorten the prompt or raise rollout.max_total_tokens ({key})")]  # fmt: skip
    assert not out.exists() or not any(out.iterdir())
    if key == "env.eval_file":  # past the probe's prompts, the same prompt is only evaluated on
        assert build_run(load_config(None, [*args[1:], "sft.probe_prompts=1"])).eval_prompts[1].text == LONG_DEMONSTRATION


def test_skip_leaves_out_and_counts_the_prompts_a_run_cannot_use(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(calculator_record("Q: 1+2=?")), '{"prompt": "Q: 2+', json.dumps(calculator_record(LONG)),
             json.dumps(calculator_record("Q: 3+4=?")), json.dumps(calculator_record("Q: 1+2=? naïve"))]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"prompt": "Q: \xff"}\n')
    with caplog.at_level(logging.WARNING, logger="sao_jax"):
        run = build_run(load_config(None, [*BASE, "sft.steps=0", f"env.train_file={path}", "env.bad_prompts=skip"]))
    assert [p.text for p in run.train_prompts] == ["Q: 1+2=?", "Q: 3+4=?"]
    assert [p.id for p in run.train_prompts] == [0, 1]
    assert run.skipped_prompts == {"env.train_file": 4}
    assert [r.getMessage() for r in caplog.records] == [
        (f"env.bad_prompts=skip: left out 4 prompts of env.train_file (the first: {path}, line 2: not valid JSON "
         "(Unterminated string starting at at column 12))")]  # fmt: skip
    with pytest.raises(DatasetError, match=rf"^{path}, line 2: not valid JSON"):
        build_run(load_config(None, [*BASE, "sft.steps=0", f"env.train_file={path}"]))  # the default: error


def test_skip_with_no_usable_prompt_left_is_an_error_naming_the_first_problem(tmp_path):
    path = write(tmp_path / "p.jsonl", [LONG])
    with pytest.raises(DatasetError, match=rf"^{path}: none of its 1 prompts is usable \(env.bad_prompts=skip\); the "
                                           rf"first: {path}, line 1: the prompt takes 85 tokens, .*\(env.train_file\)$"):
        build_run(load_config(None, [*BASE, f"env.train_file={path}", "env.bad_prompts=skip"]))
