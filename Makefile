# The two set-up commands (README): `make lab` and `make test`. Each installs what it needs into .venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Tests see 8 CPU devices, so SPMD plans are compiled and run for real.
export JAX_NUM_CPU_DEVICES ?= 8
export JAX_PLATFORMS ?= cpu

.PHONY: lab test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

$(VENV)/.installed-lab: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

# Loopback only; root (containers, CI machines) needs --allow-root.
lab: $(VENV)/.installed-lab
	$(BIN)/jupyter lab --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root,) notebooks/01_tour.ipynb

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

bench: $(VENV)/.installed-test
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
