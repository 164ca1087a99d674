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
# First this machine is measured at the job's shapes (cached), so the plan's tokens/s is this machine's.
demo: $(VENV)/.installed
	$(BIN)/megatrain probe --device cpu --model small --seq-len 128 --micro-batch 2 --dtype fp32
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
# What benchmarks/gpu/install_offline.py may need on a GPU image that has torch and no network: the
# runtime's and the CUDA tests' dependencies with theirs, for CPython 3.11-3.13 (what the script needs) on x86-64 Linux, and DeepSpeed
# (a pure wheel built here without its ops; its CPU Adam would then JIT-compile, which peers.py does not wait for)
# with its dependencies. About 20 MiB; run's `carry` takes the folder to the device.
WHEELHOUSE_DEPS = networkx jinja2 rich pytest pydantic safetensors hjson py-cpuinfo tqdm packaging einops msgpack \
	psutil nvidia-ml-py ninja
wheelhouse: $(VENV)/.installed
	for v in 3.11 3.12 3.13; do \
		$(PIP) download -q --only-binary=:all: --python-version $$v --implementation cp \
			--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
			-d benchmarks/gpu/wheelhouse $(WHEELHOUSE_DEPS) || exit 1; \
	done
	DS_BUILD_OPS=0 $(PIP) wheel -q --no-deps --no-build-isolation -w benchmarks/gpu/wheelhouse deepspeed

bench: $(VENV)/.installed-dev
	$(BIN)/python -m pytest benchmarks -m "not cuda" --benchmark-only -o addopts="" -o python_files='bench_*.py' -s

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
