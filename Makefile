# One entry point per job: `make demo` (the main job) and `make test` (lint + tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint unit bench bench-full clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.demo

lint: $(STAMP)
	$(PY) -m ruff check schedules pipeline viz benchmarks tests
	$(PY) -m mypy schedules pipeline viz benchmarks

unit: $(STAMP)
	$(PY) -m pytest -q

test: lint unit

bench: $(STAMP)
	$(PY) -m benchmarks --suite quick --out bench-out

bench-full: $(STAMP)
	$(PY) -m benchmarks --suite full --out benchmarks/results

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
