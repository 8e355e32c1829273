# Quick start:  make serve  |  make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch from the machine's CPU wheel; a plain `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
EXAMPLE_ONNX := examples/models/onnx-mlp/model.onnx
PYTEST_ARGS ?=
# Three pytest-xdist workers, each taking a whole test file at a time (its module-scoped stack is shared
# by its tests); the files that start stacks are handed out first (tests/conftest.py). Most of a lifecycle test is
# waiting for a process, so three fit two cores: 9 min 48 s to 15 min 53 s of pytest (12 min 18 s to 20 min 8 s with
# lint and the installs) on seven fresh clones of this 2-core machine with a soak on the other core beside them
# (2026-12-06, evening), against 19 min 20 s of pytest in one process before. PYTEST_WORKERS=0 runs one process.
PYTEST_WORKERS ?= 3
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
# Modules run in a random order, and so do the tests within each (pytest-random-order; a module whose tests are
# one scenario in order says so with its random_order(disabled=True) mark). pytest prints the seed:
# PYTEST_ARGS=--random-order-seed=N replays an order; PYTEST_SHUFFLE= runs in file order.
PYTEST_SHUFFLE ?= --random-order
# The python-backend runtime runs inside Triton's stub: Python 3.10 on the official 24.10 image. Its
# unit tests also run under a 3.10 interpreter when the machine has one (python3.10 on PATH, else
# pyenv's), in a small venv of its own (numpy, psutil, pytest; no snoozeml).
PYTHON310 ?= $(or $(shell python3.10 -c 'import sys; print(sys.executable)' 2>/dev/null),$(lastword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10)))
VENV310   ?= .venv310
RUNTIME_TESTS := tests/unit/test_python_backend_batching.py tests/unit/test_python_backend_runtime_parts.py \
                 tests/unit/test_prefork.py tests/unit/test_python_backend_strings.py tests/unit/test_triton_wrapper.py \
                 tests/unit/test_python_backend_bls_wake.py tests/unit/test_python_backend_doze_ask.py

.PHONY: serve test test-all test-runtime-py310 install install-dev examples bench lint clean engine images compose-test render soak

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[embedded]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed $(VENV)/.installed-torch
	$(PIP) install -e '.[embedded,dev]'
	$(PIP) install onnxscript
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(EXAMPLE_ONNX): examples/make_onnx_example.py $(VENV)/.installed
	$(PY) examples/make_onnx_example.py $@

examples: $(EXAMPLE_ONNX)

$(VENV)/.installed-torch: $(VENV)/.installed
	$(PIP) install '$(TORCH_PIN)'
	touch $@

# Local use: API keys off (serve says so loudly). The torch example needs torch in the environment.
serve: install examples $(VENV)/.installed-torch
	$(VENV)/bin/snoozectl serve --models examples/models --work-dir .snooze --no-auth

test: install-dev examples test-runtime-py310
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_SHUFFLE) $(PYTEST_ARGS)

# Every variant of every test and the long ones too (slow: the full fault matrix, soaks, the machine's random seeds,
# the bench's long sections); not the compose stack (make compose-test).
test-all: install-dev examples test-runtime-py310
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_SHUFFLE) -m 'not compose' $(PYTEST_ARGS)

$(VENV310)/.installed:
	$(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip --disable-pip-version-check -q install numpy psutil pytest pytest-timeout
	touch $@

# Every runtime module imports on 3.10 (no 3.11-only syntax or library), and its unit tests pass there.
# Without the repository's pytest config and conftest: those need the control plane's environment. tests/ is
# still on the path (the harness package), given absolute: -c /dev/null would resolve a relative one from /dev.
test-runtime-py310:
ifeq ($(PYTHON310),)
	@echo "python_backend on Python 3.10: SKIPPED (no python3.10 on PATH or under ~/.pyenv/versions)"
else
	@$(MAKE) --no-print-directory $(VENV310)/.installed
	@echo "python_backend on Python 3.10 ($(PYTHON310)):"
	PYTHONDONTWRITEBYTECODE=1 $(VENV310)/bin/python -c "import importlib, pkgutil, python_backend as p; \
		[importlib.import_module('python_backend.' + m.name) for m in pkgutil.iter_modules(p.__path__)]"
	$(VENV310)/bin/python -m pytest -c /dev/null --rootdir . --noconftest -o pythonpath=$(CURDIR)/tests \
		-p no:cacheprovider -q $(RUNTIME_TESTS)
endif

# docker-compose.yml and deploy/k8s/base/{deployment,services}.yaml from one description (deploy/stack.toml)
# and their templates (deploy/templates/); tests/unit/test_deploy_render.py fails when they differ.
render:
	$(PYTHON) deploy/render.py

# The shipped docker-compose.yml in a Docker engine (tests/compose, marker `compose`; not in `make test`).
# engine: start one if none answers (as root: apt-get install docker.io, dockerd --bridge=none ...); its exit
# code says why it cannot (deploy/docker/engine.sh). images: built offline, cached by content.
engine:
	deploy/docker/engine.sh

images: engine
	deploy/docker/build-images.sh

# The images are built before pytest starts (a first build takes minutes: outside its per-test timeout).
compose-test: install-dev images
	@command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
		|| DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-compose \
		|| echo "compose-test: no compose binary and docker-compose could not be installed: the tests skip"
	$(PY) -m pytest tests/compose -m compose -p no:cacheprovider $(PYTEST_ARGS)

# The lifecycle state machine on fresh random seeds (tests/model/test_lifecycle_machine.py: each seed drives the
# plain machine, then the one with dozing models), one after another, each seed printed: SOAK_SEEDS=200 make soak. Stops at the first seed that finds a violation (its shrunk sequence
# is printed; SNOOZE_MACHINE_SEED=<seed> replays it); SOAK_SEEDS=0 runs until interrupted.
SOAK_SEEDS ?= 20
soak: install-dev
	@n=0; while [ "$(SOAK_SEEDS)" = 0 ] || [ $$n -lt $(SOAK_SEEDS) ]; do \
		n=$$((n + 1)); seed=$$($(PY) -c 'import random; print(random.randrange(2**32))'); \
		echo "soak $$n/$(SOAK_SEEDS): SNOOZE_MACHINE_SEED=$$seed"; \
		SNOOZE_MACHINE_SEED=$$seed $(PY) -m pytest -p no:cacheprovider -q -m slow \
			tests/model/test_lifecycle_machine.py -k random_operations || { echo "soak: seed $$seed failed"; exit 1; }; \
	done; echo "soak: $$n seeds clean"

bench: install-dev examples
	$(PY) -m bench

# ruff's lint and format check over the Python folders, then mypy (pyproject.toml's [tool.mypy]: strict on
# controlplane/lifecycle and controlplane/gateway). python_backend/ is checked once more as Python 3.10, the
# interpreter of Triton's stub; that run keeps a cache of its own, so neither invalidates the other's.
LINT_PATHS := controlplane python_backend converters tests bench examples deploy model_repository_templates
lint: install-dev
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --python-version 3.10 --cache-dir .mypy_cache/py310 python_backend

clean:
	rm -rf .snooze build dist *.egg-info
