# One entry point for set-up, the demo, the tests and the benchmarks.
# `make demo` and `make test` work on a fresh machine: they build .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/hvdrun
# The CPU build of PyTorch for CI and development; GPU users install their own torch.
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test lint bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev,mpi]" mpich
	touch $@

demo: venv
	$(HVDRUN) -np 2 examples/linear_regression.py --check

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check hvdrun tests examples
	$(VENV)/bin/mypy hvdrun

bench: venv
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/training.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
