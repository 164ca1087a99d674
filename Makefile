# megatrain: `make demo` trains the default job on CPU; `make test` runs the test suite.
# Each target creates .venv if missing and installs what it needs (pinned by constraints.txt).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: demo hf test test-slow test-cuda gpu-check wheelhouse bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-hf: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[hf]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

# The default job: the small preset (19.7M params, 75 MiB of fp32 weights) trained on the built-in corpus,
# streamed through a simulated GPU with a 56 MiB budget, so weights really stream. A few minutes on 2 cores.
demo: $(VENV)/.installed
	$(BIN)/megatrain train --model small --device sim --gpu-mem 56MiB --dtype fp32 --seq-len 128 \
		--micro-batch 2 --grad-accum 4 --steps 50 --lr 2e-3 --clip-norm 1.0 --eval-every 10 \
		--metrics out/demo/metrics.jsonl --trace out/demo/trace.json

# Hugging Face model folders and tokenizers (transformers, tokenizers): the README's fine-tuning section.
hf: $(VENV)/.installed-hf

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest

test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -m slow

# On a GPU machine, offline: the tree linked in as the package, the image's torch (benchmarks/gpu/run.sh);
# fails, not skips, when no GPU is visible. `make gpu-check` adds the benchmark (results under OUT).
test-cuda:
	PYTHON=$(PYTHON) bash benchmarks/gpu/run.sh --tests-only

gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu/run.sh

# The pure-Python dependencies as wheels, for a GPU image that lacks them (run where there is a network).
wheelhouse: $(BIN)/python
	$(PIP) download -q -c constraints.txt --only-binary=:all: --no-deps -d benchmarks/gpu/wheelhouse \
		networkx jinja2 markupsafe rich pygments markdown-it-py mdurl pytest pluggy iniconfig packaging

bench: $(VENV)/.installed-dev
	$(BIN)/python -m pytest benchmarks -m "not cuda" --benchmark-only -o addopts="" -o python_files='bench_*.py' -s

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
