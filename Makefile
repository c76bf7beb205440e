# `make bench` and `make test` set up everything they need in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned here (a CPU build these machines keep on disk); pyproject.toml states the supported range.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,bench,torchtitan,lint]'
	touch $@

.PHONY: bench test test-fast lint
bench: $(VENV)/.installed
	$(VENV)/bin/ckptio bench $(ARGS)

# Lint and format checks first: seconds, and they fail before minutes of tests.
test: lint
	$(PY) -m pytest -q $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(ARGS)
