# One entry point for set-up, the demo, the tests and the benchmarks.
# `make demo` and `make test` work on a fresh machine: they build .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/hvdrun
# The CPU build of PyTorch for CI and development; GPU users install their own torch.
TORCH_PIN := torch==2.13.0

.PHONY: venv system-deps demo test lint bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev,mpi]" mpich
	touch $@

# Tests start real sshd servers in network namespaces: install openssh-server when missing (root + apt only;
# elsewhere those tests skip with the reason).
system-deps:
	@if [ ! -x /usr/sbin/sshd ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing openssh-server for the SSH tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server iproute2 >/dev/null; \
	fi

demo: venv
	$(HVDRUN) -np 2 examples/linear_regression.py --check

test: venv system-deps
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check hvdrun tests examples
	$(VENV)/bin/mypy hvdrun

bench: venv
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/training.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
