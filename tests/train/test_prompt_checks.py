"""Prompt files are checked against the run before any work: a character the tokenizer lacks, or a
prompt that leaves no room for an action within `rollout.max_total_tokens`, is one line naming the
file, the line (and column) and the key, and `sao-train` exits 2 at once, not after minutes of SFT."""

import json
import subprocess
import sys
import time

import pytest

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


def write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


def check(prompt_text, line=None, *overrides):
    config = load_config(None, [*BASE, *overrides])
    prompt = Prompt(id=0, text=prompt_text, answer="1", difficulty=1)
    return check_prompt(config, environment_class(config.env.name), CharTokenizer(), None, prompt, line)


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
