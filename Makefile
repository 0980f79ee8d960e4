# Two commands for a fresh machine with Python 3.11:  make demo  /  make test
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-ci.txt
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

test: install
	-bash scripts/ensure-chromium.sh   # headless Chromium for the `show --html` screenshot test (needs root)
	-bash scripts/ensure-bubblewrap.sh # the sandbox for model-written code (needs root)
	$(BIN)/python -m pytest

demo: install
	-bash scripts/ensure-bubblewrap.sh # the demo scores model-written code in it
	$(BIN)/marslm demo --preset default --out runs/demo

clean:
	rm -rf $(VENV) runs .pytest_cache
