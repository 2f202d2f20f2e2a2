# The two README commands: `make demo` and `make test`. Each sets up .venv when needed.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
# The CPU wheel on this machine's disk; an already installed torch (e.g. a CUDA build) is kept.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export DO_NOT_TRACK := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint bench llama

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/thresher demo

# lint first: a ruff finding or a broken import layer fails before the (longer) tests run. The
# tests' trained model is built (or found cached) before pytest, outside the per-test timeout: its
# first training takes 1 min on 2 idle cores and over 5 on loaded ones.
test: setup lint
	$(VENV)/bin/thresher demo-model build tiny
	$(PY) -m pytest -q $(PYTEST_ARGS)

# llama.cpp for the GGUF tests and benchmark: pip builds it from source (about 18 min on 2 cores).
llama: setup
	$(PY) -m pip install -q -e ".[llama]"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
