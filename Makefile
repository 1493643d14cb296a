# One entry point per job: `make demo` (the main job) and `make test` (lint + tests); `make docs`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-busy lint unit random cpu-paths docs bench bench-full gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The demo needs less than the tests: the pinned torch and the package itself (tqdm, numpy; its
# picture is drawn by viz's SVG renderer, written by hand, so no extra). A first install
# downloads torch (about 200 MB): pip shows its progress. With the full install already made
# (`make test`), nothing is installed.
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then \
		echo "make demo: the full install ($(STAMP)) has what the demo needs"; \
	else \
		echo "make demo: installing $(TORCH_PIN), then this package (tqdm, numpy) into $(VENV)"; \
		$(PY) -m pip install --upgrade pip && \
		$(PY) -m pip install $(TORCH_PIN) && \
		$(PY) -m pip install -e . ; \
	fi
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m benchmarks.demo

lint: $(STAMP)
	$(PY) -m ruff check schedules pipeline viz benchmarks tests
	$(PY) -m mypy schedules pipeline viz benchmarks

# Three pytest-xdist workers on CI's two cores: most tests wait on ranks, launchers and
# heartbeats. loadgroup: tests sharing a module's fixture, and `alone` tests, are placed by
# tests/workers.py (docs/testing.md#on-several-workers).
unit: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=40

# CI's hypothesis profile is derandomized (a red build reproduces); this batch of the
# transparency property draws fresh examples on every run, so CI keeps exploring too.
# A failure prints the falsifying example (every argument), which reproduces it.
random: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_transparency.py::test_pipe_equals_single_device \
		tests/test_transparency.py::test_any_stage_graph_equals_single_device

# The numerically sensitive tests once more under each of torch's other CPU kernels that this
# CPU has (ATEN_CPU_CAPABILITY=default, avx2, avx512; tests/cpu_paths.py): a tolerance that
# holds on one CPU's kernels only fails on every machine, not only on another one.
cpu-paths: $(STAMP)
	$(PY) -m tests.cpu_paths

test: lint unit random cpu-paths

# `make test` beside one spinning process per core, stopped when the run ends however it ends
# (tests/busy.py): what must hold on a laptop or a shared runner must hold here too. The exit
# checks (tests/test_exit.py, the docs' multi-process examples) launch 3 times as often.
test-busy: $(STAMP)
	TEST_EXIT_REPEAT=3 $(PY) -m tests.busy $(MAKE) test

# The documentation's tests alone (`unit` runs them too): every Python block of README.md and
# docs/*.md runs, shell command lines parse, relative links resolve. Offline, CPU.
docs: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_docs.py

bench: $(STAMP)
	$(PY) -m benchmarks --suite quick --out bench-out

bench-full: $(STAMP)
	$(PY) -m benchmarks --suite full --out benchmarks/results

# On a machine with a GPU, with torch built for it and the dev extra installed (the pinned CPU
# build above is not): the GPU tests, then the one-GPU suite into benchmarks/results/gpu
# (docs/benchmarks.md). A few minutes in all.
gpu-check:
	$(PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests/pipeline/test_gpu.py tests/test_docs.py
	$(PYTHON) -m benchmarks --suite gpu --device cuda --no-progress --out benchmarks/results/gpu

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
