# The set-up commands (README): `make lab`, `make test` (`make test-fast`: what is not marked slow) and `make lint`.
# Each installs what it needs into .venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Tests see 8 CPU devices, so SPMD plans are compiled and run for real.
export JAX_NUM_CPU_DEVICES ?= 8
export JAX_PLATFORMS ?= cpu
XDIST ?= -n auto --maxprocesses 4 --dist loadgroup

.PHONY: lab test test-fast lint bench clean browser js

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# --no-compile: pip would byte-compile every installed module (Ray's and JupyterLab's included), ~40 CPU-s of a fresh
# install (68 -> 28 user-s measured on 2 cores); Python compiles the modules a process imports on first use instead.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e ".[test]"
	touch $@

$(VENV)/.installed-lint: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e ".[lint]"
	touch $@

$(VENV)/.installed-lab: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e ".[dev]"
	touch $@

# Loopback only; root (containers, CI machines) needs --allow-root.
lab: $(VENV)/.installed-lab js
	$(BIN)/jupyter lab --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root,) notebooks/01_tour.ipynb

# The real-browser test drives Debian's Chromium: installed here when we may (root with apt-get); elsewhere that test
# skips and says why.
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's chromium for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

# The operator graph's front end (extensions/graph): its JavaScript tests, and its committed bundle rebuilt from the
# sources (the same bytes when nothing changed). Without npm (or without the registry, for a first install) the
# committed bundle is used and the JS tests are skipped; a failing JS test fails the target.
js:
	@cd extensions/graph && if ! command -v npm >/dev/null; then echo "npm not found: JS tests skipped"; \
	elif [ ! -d node_modules ] && ! npm ci --no-audit --no-fund; then echo "npm ci failed: JS tests skipped"; \
	else npm run --silent build && npm test --silent; fi

# Two pytest-xdist workers on 2 cores (at most 4 on bigger machines); tests/conftest.py groups the tests by file (each
# notebook run and browser test alone), keeps the files that start Ray on one worker and sends the longest groups first.
# `make test XDIST=` runs them in one process. (3 workers on 2 cores measured no faster on 4 slow files, load 9-12.)
test: $(VENV)/.installed-test browser js
	$(BIN)/python -m pytest -q -ra $(XDIST) $(PYTEST_ARGS)

# The tests not marked slow, with no notebook and no browser: the quick check while working (under 3 minutes on 2
# cores; tests/conftest.py's SLOW_TESTS lists the end-to-end tests it leaves to `make test`).
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -ra -m "not slow and not notebook and not browser" $(XDIST) $(PYTEST_ARGS)

# ruff (pyproject.toml [tool.ruff]) on the package, tests and benchmarks; mypy ([tool.mypy]) on the engine.
lint: $(VENV)/.installed-lint
	$(BIN)/ruff check autopar_lab tests bench
	$(BIN)/mypy

bench: $(VENV)/.installed-test
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .jax-cache
