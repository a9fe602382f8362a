# Two commands on a fresh machine with Python >= 3.11:  `make train`  and  `make test`.
# Each creates .venv and installs what it needs the first time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pytest-xdist workers; each takes whole test files (tests/conftest.py starts the longest first).
TEST_WORKERS ?= 2
# pip prints errors only: a machine's pip configuration can add a warning line per package (an extra
# index folder that lacks it, say), a wall of them before the first step.
PIP_INSTALL = -m pip install --quiet --quiet

.PHONY: train test test-fast test-hf4 bench clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "sao_jax needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python $(PIP_INSTALL) -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python $(PIP_INSTALL) -e '.[dev]'
	touch $@ $(VENV)/.runtime

# The benchmarks' peers (Tunix pins safetensors<0.8, so transformers 4.x) live in a venv of their own.
BENCH_VENV := .venv-bench

$(BENCH_VENV)/.bench: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python $(PIP_INSTALL) --upgrade pip
	$(BENCH_VENV)/bin/python $(PIP_INSTALL) -e '.[bench]'
	touch $@

# transformers 4.57.1 (and the huggingface_hub and tokenizers it needs) laid over .venv's packages
# for `make test-hf4`: the HF tests against the last 4.x, the suite itself runs against 5.x.
HF4 := .venv-hf4
HF_TESTS := tests/models/test_config.py tests/models/test_hf_parity.py  # the files that check against transformers

$(HF4)/.installed: | $(VENV)/.dev
	$(BIN)/python $(PIP_INSTALL) --no-deps --target $(HF4) \
		transformers==4.57.1 huggingface_hub==0.36.2 tokenizers==0.22.2
	$(BIN)/python $(PIP_INSTALL) --target $(HF4) requests  # huggingface_hub 0.x needs it; 1.x does not
	touch $@

train: $(VENV)/.runtime
	$(BIN)/sao-train $(ARGS)

test: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

test-hf4: $(VENV)/.dev $(HF4)/.installed
	PYTHONPATH=$(HF4) $(BIN)/python -c 'import transformers; assert transformers.__version__ == "4.57.1"'
	PYTHONPATH=$(HF4) $(BIN)/python -m pytest -p no:xdist $(HF_TESTS) $(PYTEST_ARGS)

bench: $(BENCH_VENV)/.bench
	$(BENCH_VENV)/bin/python benchmarks/gae.py
	$(BENCH_VENV)/bin/python benchmarks/model.py
	$(BENCH_VENV)/bin/python benchmarks/sampler.py

clean:
	rm -rf $(VENV) $(HF4) $(BENCH_VENV) .pytest_cache .hypothesis
