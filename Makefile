# Set-up is two commands on a fresh machine with python3 and make: `make demo`, `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check \
	    -c requirements/constraints.txt -e '.[training,dev]'
	touch $(STAMP)

# A local 2-rank training run on real text with one injected fault per restart layer.
demo: $(STAMP)
	$(BIN)/python -m training.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The fast, torch-free and single-process tests only.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not slow"

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache
