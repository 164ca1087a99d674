# megatrain: `make demo` trains the default job on CPU; `make test` runs the test suite.
# Each target creates .venv if missing and installs what it needs (pinned by constraints.txt).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: demo hf test test-slow test-cuda test-cuda-fake gpu-check gpu-bundle gpu-rehearse wheelhouse bench lint \
	clean

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
# Each demo is a new run, and a new run refuses a metrics file holding an earlier run's records: the last
# demo's is removed first (out/ is the scratch folder git ignores).
demo: $(VENV)/.installed
	$(BIN)/megatrain probe --device cpu --model small --seq-len 128 --micro-batch 2 --dtype fp32
	rm -f out/demo/metrics.jsonl
	$(BIN)/megatrain train --model small --device sim --gpu-mem 56MiB --dtype fp32 --seq-len 128 \
		--micro-batch 2 --grad-accum 4 --steps 50 --lr 2e-3 --clip-norm 1.0 --eval-every 10 \
		--metrics out/demo/metrics.jsonl --trace out/demo/trace.json

# Hugging Face model folders and tokenizers (transformers, tokenizers): docs/FINETUNING.md.
hf: $(VENV)/.installed-hf

# The default suite, then every test marked `cuda` on the fake CUDA backend (megatrain/fake_cuda/).
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory test-cuda-fake

# The CUDA code path on this CPU: tensors on "cuda" are CPU tensors that say so, torch.cuda's streams, events and
# memory are stand-ins that check the stream protocol (megatrain/fake_cuda/__init__.py).
test-cuda-fake: $(VENV)/.installed-dev
	MEGATRAIN_FAKE_CUDA=1 $(BIN)/python -m pytest -m cuda

test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -m slow

# On a GPU machine, offline, from the tree and the carried bundle (benchmarks/gpu/run.sh, docs/GPU.md); fails,
# not skips, when no GPU is visible; without benchmarks/gpu/bundle/ it stops at once and says so. `make gpu-check`
# is the whole device run (results under OUT).
test-cuda:
	PYTHON=$(PYTHON) bash benchmarks/gpu/run.sh --tests-only

gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu/run.sh

# The wheels the device image lacks (pydantic and its dependencies, hjson, nvidia-ml-py, DeepSpeed built here as
# a DS_BUILD_OPS=0 wheel) for its Python 3.12, and for this Python what the CPU rehearsal's venv of torch and
# numpy lacks besides: benchmarks/gpu/bundle/ (git-ignored, about 11 MiB, checked under 30 MiB), which the
# device call carries. Run where a registry is reachable. `wheelhouse` is its former name.
gpu-bundle: $(VENV)/.installed
	$(BIN)/python benchmarks/gpu/bundle.py

wheelhouse: gpu-bundle

# The device run rehearsed on this CPU machine: every stage under the fake CUDA backend at tiny sizes.
gpu-rehearse: gpu-bundle
	bash benchmarks/gpu/run.sh --rehearse

bench: $(VENV)/.installed-dev
	$(BIN)/python -m pytest benchmarks -m "not cuda" --benchmark-only -o addopts="" -o python_files='bench_*.py' -s

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
