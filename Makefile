# Quick start:  make serve  |  make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch from the machine's CPU wheel; a plain `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
EXAMPLE_ONNX := examples/models/onnx-mlp/model.onnx
PYTEST_ARGS ?=

.PHONY: serve test install install-dev examples bench lint clean

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

test: install-dev examples
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install-dev examples
	$(PY) -m bench

lint: install-dev
	$(VENV)/bin/ruff check controlplane python_backend converters tests bench examples

clean:
	rm -rf .snooze build dist *.egg-info
