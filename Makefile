# `make test`, `make check` and `make demo` create .venv from nothing (Python >= 3.10 and
# network access to the package index), with the exact versions of requirements.lock.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rankguard-installed
LOCK := requirements.lock

.PHONY: venv test check lint demo docs bench lock clean

# uv installs the same pins as pip would, in a quarter of the time (parallel downloads);
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, every rank of every
# test run would otherwise compile torch and the frameworks from source (imports 2x slower).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) uv
	$(BIN)/uv pip install --compile-bytecode --python $(BIN)/python -c $(LOCK) pip setuptools wheel -e '.[all,test]'
	touch $(STAMP)

venv: $(STAMP)

# mypy over the public surface: the README's quickstart for every integration and the
# integration modules, against the package as installed (tools/typecheck.py; about 1 s).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/typecheck.py

# Everything: unit tests and every real multi-rank framework run (what CI runs), on two
# workers (each test file stays on one); then, alone, the tests that compare ranks'
# measured compute times (marker `timing`), which a second worker's load would skew.
test: lint
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not timing" --durations=15
	$(BIN)/python -m pytest -m timing --durations=5

# The inner loop: lint and every test that starts no framework launcher, on two workers
# (each test file stays on one).
check: lint
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not framework" -q --durations=5

demo: venv
	$(BIN)/python examples/demo.py

# Regenerates docs/reference.md, docs/failures.md and README.md's failure table; reruns
# the example runs whose recorded output (docs/outputs/) no longer matches the code.
docs: venv
	$(BIN)/python docs/generate.py

bench: venv
	$(BIN)/python benchmarks/overhead.py

# The one deliberate way to move to newer releases: resolves the extras' ranges in a
# scratch environment and rewrites requirements.lock with what it installed.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --upgrade pip setuptools wheel
	.venv-lock/bin/python -m pip install uv '.[all,test]'
	{ echo "# Exact versions of the environment make creates (pip -c). Refresh: make lock."; \
	  .venv-lock/bin/python -m pip freeze --all | grep -v '^rankguard'; } > $(LOCK)
	rm -rf .venv-lock build *.egg-info

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
