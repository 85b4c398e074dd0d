# Tandem: see README.md. Every target sets up what it needs.
SHELL := /bin/bash
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
PROTOS := $(wildcard protos/tandem/v1/*.proto)
STUBS := tandem/v1/__init__.py
PYTEST_ARGS ?=
# Test processes (pytest-xdist); tests of one file share a process. 0: one process.
TEST_WORKERS ?= 2
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder  # tests/conftest.py's LONG_FILES first
BENCH_ARGS ?=
NODES_ARGS ?=
DEMO_ARGS ?=

.PHONY: help setup protos models redis demo test test-fast bench bench-nodes clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.installed: pyproject.toml
	$(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[dev]'
	touch $@

$(STUBS): $(PROTOS) $(VENV)/.installed
	mkdir -p tandem/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

setup: $(VENV)/.installed $(STUBS)  ## Virtualenv, dependencies, generated gRPC stubs

protos: $(STUBS)  ## Generate the gRPC stubs into tandem/v1 (ignored by git)

models: setup  ## Fetch and convert the default model pair (once, ~1.6 GB)
	$(PY) -m tandem.default_models

redis: setup  ## Start a local Redis if REDIS_URL is unset and nothing listens on 6379
	@$(PY) -m tandem.redis_local

demo: models redis  ## Set up everything and run the demo on the default pair
	$(PY) -m tandem.demo $(DEMO_ARGS)

test: models redis  ## Set up and run the whole test suite (includes the slow real-pair test)
	$(PY) -m pytest -q $(PYTEST_PAR) $(PYTEST_ARGS)

test-fast: setup redis  ## Tests without the real model pair
	$(PY) -m pytest -q $(PYTEST_PAR) -m "not slow" $(PYTEST_ARGS)

bench: models redis  ## Both benchmarks: bench/results/latest.json, then bench-nodes
	$(PY) -m bench.bench $(BENCH_ARGS)
	$(PY) -m bench.nodes $(NODES_ARGS)

bench-nodes: models redis  ## Two-node benchmark (cores pinned): bench/results/nodes.json and nodes.png
	$(PY) -m bench.nodes $(NODES_ARGS)

clean:  ## Remove the generated stubs and the virtualenv
	rm -rf tandem/v1 $(VENV) *.egg-info
