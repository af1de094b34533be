# One entry point for set-up, the demo, the tests and the benchmarks.
# `make demo` and `make test` work on a fresh machine: they build .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/hvdrun
# The CPU build of PyTorch for CI and development; GPU users install their own torch.
TORCH_PIN := torch==2.13.0

.PHONY: venv system-deps demo test lint bench docs clean compiled

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev,mpi,docs]" mpich
	touch $@

# Tests start real sshd servers in network namespaces, and a real Slurm cluster and a real OpenPBS on them: install
# openssh-server, slurm-wlm (with its Torque-style qsub/qstat/qdel) and munge when missing, and build OpenPBS from
# the source in tests/infra/openpbs/ into /opt/pbs once per machine (apt build deps, then about 2 minutes on 2
# cores). Headless Chromium opens the job report (--report) in its test. Root + apt only; elsewhere those tests
# skip with the reason.
system-deps:
	@if { [ ! -x /usr/sbin/sshd ] || ! command -v slurmctld >/dev/null || ! command -v qsub >/dev/null \
			|| ! command -v chromium >/dev/null; } && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing openssh-server, slurm-wlm, slurm-wlm-torque, munge and chromium for the SSH, Slurm and" \
			"report tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server iproute2 \
			slurm-wlm slurm-wlm-torque munge >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	fi
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then bash tests/infra/pbs_cluster.sh build; fi

# The optional compiled module (hvdrun/runtime/compiled): the steady state's steps across hosts in one call of C.
# Never built on install; HVDRUN_COMPILED=off keeps the pure-Python path where it is built. The suite builds it and
# tests both paths.
compiled: venv
	$(PY) -m hvdrun.runtime.compiled

demo: venv
	$(HVDRUN) -np 2 examples/linear_regression.py --check

# Three pytest-xdist workers on 2 cores: a test waits for part of its time (a rank's start, a timeout it provokes,
# a scheduler's poll), and the third worker fills those waits. Measured on this 2-core VM with the zygote-forked
# and preloaded ranks: two workers 502 s with 780 CPU-s busy (78 % of the cores), three 399 s with 716 CPU-s
# (90 %). Earlier, with about 1,000 CPU-s of work, three overloaded the machine and timing-sensitive tests failed.
# --dist loadfile gives all of a file's tests to one worker: the Slurm tests
# (test_scheduler_jobs.py) and the PBS tests (test_pbs.py) start one cluster each. (Not loadgroup: with pytest 9.2
# it silently ignores xdist_group marks, pytest-xdist issue #1386.)
# Byte-compiled first: with PYTHONDONTWRITEBYTECODE set (as in some CI images) no import writes a .pyc, and every
# rank, launcher and probe the suite starts (about 1,600) would compile the checkout's modules again.
test: venv system-deps compiled
	PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q -j 2 hvdrun tests examples benchmarks >/dev/null
	$(PY) -m pytest -q -n 3 --dist loadfile

lint: venv
	$(VENV)/bin/ruff check hvdrun tests examples benchmarks
	$(VENV)/bin/mypy hvdrun

bench: venv
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/training.py

# The documentation site (mkdocs.yml, pages in docs/) into build/site; any warning (a broken link or anchor)
# fails the build. NO_MKDOCS_2_WARNING silences the theme's end-of-life banner (not a build warning).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
