VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DURATION ?= 60

.PHONY: demo test test-hosts bench install clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/reamer demo --duration $(DURATION)

test: install
	$(PY) -m pytest -q -rR --reruns 1 --reruns-delay 2 tests

# Production-like hosts in QEMU VMs (lab/, tests/hosts/): PROFILES="v1 v2-numa" boots only those.
test-hosts: install
	$(PY) -m lab $(foreach p,$(PROFILES),--profile $(p))

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
