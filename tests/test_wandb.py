"""Optional Weights & Biases logging: off by default, the same lines as metrics.jsonl when on."""

import json
import sys
import types

import numpy as np
import pytest

from sao_jax.config import load_config
from sao_jax.metrics import MetricsWriter


class FakeWandb(types.ModuleType):
    """A stand-in `wandb` module that records every call."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_is_off_by_default():
    config = load_config(None)
    assert config.train.wandb is False
    assert config.train.wandb_project == "sao_jax"


def test_every_line_goes_to_wandb_with_its_step(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsWriter(tmp_path / "run", tensorboard=False, wandb_project="proj", config={"seed": 3}) as writer:
        writer.write(0, {"stage": "sft", "sft/nll": np.float32(2.5), "flag": True, "bad": float("nan")})
        writer.write(1, {"train/reward_mean": 0.75, "count": np.int32(4)})
    assert fake.calls[0] == ("init", {"project": "proj", "name": "run", "dir": str(tmp_path / "run"),
                                      "config": {"seed": 3}})  # fmt: skip
    lines = [json.loads(text) for text in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The numeric entries of each written line (strings, booleans and NaN → null are not charted).
    assert fake.calls[1:] == [
        ("log", {"sft/nll": 2.5}, 0),
        ("log", {"train/reward_mean": 0.75, "count": 4}, 1),
        ("finish",),
    ]
    assert [line["step"] for line in lines] == [0, 1]


def test_missing_wandb_is_a_one_line_error_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r"^train.wandb is true but wandb is not installed: pip install wandb$"):
        MetricsWriter(tmp_path, tensorboard=False, wandb_project="proj")
