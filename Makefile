VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DURATION ?= 60

.PHONY: demo test test-hosts bench bench-full install install-base test-packages clean

# Debian packages the suite drives for real (a private Slurm: tests/slurm). Installed when run as root with
# apt-get; elsewhere the tests that need them skip, saying why.
TEST_PACKAGES := slurmctld slurmd slurm-client munge runc busybox-static  # runc, busybox: tests/nri

# The package and what it runs on (what `make demo` needs): no test or bench extras (torch, transformers, ...).
$(VENV)/.installed-base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	touch $@

# Everything: the package with its test and bench extras (`make test`, `make test-hosts`, `make bench`).
$(VENV)/.installed: $(VENV)/.installed-base
	$(PIP) install --quiet -e '.[test,bench]'
	touch $@

install-base: $(VENV)/.installed-base

install: $(VENV)/.installed

demo: install-base
	$(VENV)/bin/reamer demo --duration $(DURATION)

test-packages:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(TEST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "installing $$missing (tests/slurm)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null) \
	      || echo "could not install $$missing: the Slurm and NRI tests will skip"; \
	  fi; \
	  scripts/get_containerd17.sh >/dev/null || echo "could not fetch containerd 1.7: tests/nri will skip"; \
	fi

test: install test-packages
	$(PY) -m pytest -q -rR --reruns 1 --reruns-delay 2 tests

# Production-like hosts in QEMU VMs (lab/, tests/hosts/): PROFILES="v1 v2-numa" boots only those.
test-hosts: install
	$(PY) -m lab $(foreach p,$(PROFILES),--profile $(p))

# Every benchmark with a figure in bench/RESULTS.md: `bench` at smoke settings (or the full run where it is
# short; about 13 minutes on 2 cores), `bench-full` with each figure's own command (hours; rewrites RESULTS.md).
bench: install
	$(PY) -m bench.run_all

bench-full: install
	$(PY) -m bench.run_all --full

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
