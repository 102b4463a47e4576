# `make test` and `make demo` create .venv from nothing (Python >= 3.10 and
# network access to the package index), then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rankguard-installed

.PHONY: venv test lint demo docs bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -e '.[all,test]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest

demo: venv
	$(BIN)/python examples/demo.py

# Regenerates docs/reference.md, docs/failures.md and README.md's failure table; reruns
# the example runs whose recorded output (docs/outputs/) is older than the code.
docs: venv
	$(BIN)/python docs/generate.py

bench: venv
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
