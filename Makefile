# Two commands on a fresh machine with Python >= 3.11:  `make train`  and  `make test`.
# Each creates .venv and installs what it needs the first time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pytest-xdist workers; each takes whole test files (tests/conftest.py starts the longest first).
TEST_WORKERS ?= 2

.PHONY: train test test-fast bench clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "sao_jax needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.runtime

$(VENV)/.bench: pyproject.toml $(VENV)/.dev
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $@

train: $(VENV)/.runtime
	$(BIN)/sao-train $(ARGS)

test: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/gae.py
	$(BIN)/python benchmarks/model.py
	$(BIN)/python benchmarks/sampler.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
