VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DURATION ?= 60

.PHONY: demo test bench install clean

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

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
