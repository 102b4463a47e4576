# Two locked environments, one per world rankguard supports (README, "Tested versions"):
#   .venv           today's stack: torch 2.13, Lightning 2.6, transformers 5, datasets 5,
#                   OLMo-core 3 (requirements.lock); the HF Trainer, OLMo-core, Lightning and loops
#   .venv-composer  Composer's stack: mosaicml 0.32.1 pins torch < 2.7.1 and mosaicml-streaming
#                   0.13 transformers < 5 (requirements-composer.lock); Composer, and the older
#                   Lightning/transformers 4/OLMo-core 2.4 users who have not upgraded
# `make test` creates both from nothing (Python >= 3.11 and the package index); `make demo` and
# `make check` only the one they run in.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements.lock
VENV_COMPOSER := .venv-composer
CBIN := $(VENV_COMPOSER)/bin
LOCK_COMPOSER := requirements-composer.lock
STAMP := .rankguard-installed
# The extras each world installs (rankguard[all] is Composer's world: it includes Composer).
EXTRAS := lightning,transformers,olmo-core,report,test
EXTRAS_COMPOSER := all,test
PYTEST := -m pytest -n 2 --dist loadfile
# make test's workers: 4 on 2 cores. Its runs spend much of their time waiting out deadlines,
# so 2 workers left the cores idle (today's world 10:53, Composer's 8:17 on 2 workers; 7:50
# and 7:49 on 4, 2026-11-30); the bounds the tests assert are sized for twice the load.
PYTEST_ALL := -m pytest -n 4 --dist loadfile

.PHONY: venv venv-composer envs test test-today test-composer check lint demo docs bench lock \
	install-check clean

# uv installs the lock's pins in a quarter of pip's time (parallel downloads); torch comes first
# through pip, which honours the machine's pip configuration (a local wheel folder or a CPU-only
# index) that uv does not read. --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE
# is set, every rank of every test would otherwise compile the frameworks from source.
$(VENV)/$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) uv torch
	$(BIN)/uv pip install --compile-bytecode --python $(BIN)/python -c $(LOCK) pip setuptools wheel -e '.[$(EXTRAS)]'
	touch $@

$(VENV_COMPOSER)/$(STAMP): pyproject.toml $(LOCK_COMPOSER)
	test -x $(CBIN)/python || $(PYTHON) -m venv $(VENV_COMPOSER)
	$(CBIN)/python -m pip install -q -c $(LOCK_COMPOSER) uv
	$(CBIN)/uv pip install --compile-bytecode --python $(CBIN)/python -c $(LOCK_COMPOSER) pip setuptools wheel -e '.[$(EXTRAS_COMPOSER)]'
	touch $@

venv: $(VENV)/$(STAMP)
venv-composer: $(VENV_COMPOSER)/$(STAMP)
# Both at once (their downloads and installs overlap: 64 s against 83 s one after the other).
envs:
	$(MAKE) -j2 venv venv-composer

# ruff over the tree; mypy over the public surface: the README's quickstart for every
# integration and the integration modules (tools/typecheck.py; the frameworks read as Any).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/typecheck.py

# Everything (what CI runs): in each world, the unit tests and the real multi-rank runs of the
# frameworks that live there (markers in tests/conftest.py), on four workers (each test file
# stays on one); then, alone, the tests that compare ranks' measured compute times (marker
# `timing`), which a second worker's load would skew. Composer's world also runs a short smoke
# of the older Lightning, transformers 4 and OLMo-core 2.4 (marker `older`).
test: envs lint test-today test-composer

# The suites write bytecode caches (git ignores them) even where PYTHONDONTWRITEBYTECODE is
# set: each of their ~900 processes would otherwise compile rankguard and its tests again,
# and each xdist worker rewrite every test file's assertions again at collection.
test-today test-composer check: export PYTHONDONTWRITEBYTECODE :=

test-today: venv
	$(BIN)/python $(PYTEST_ALL) -m "not composer and not older and not timing" --durations=10
	$(BIN)/python -m pytest -m "timing and not composer" --durations=3

test-composer: venv venv-composer
	$(CBIN)/python $(PYTEST_ALL) -m "(not framework or composer or older) and not timing" --durations=10
	$(CBIN)/python -m pytest -m "timing and composer" --durations=3

# The inner loop (about a minute): lint and every test that starts no framework launcher and
# takes under a second or two (marker `slow`: the multi-process scenarios that wait out real
# deadlines, which make test runs in both worlds), in today's stack.
check: lint
	$(BIN)/python $(PYTEST) -m "not framework and not composer and not slow" -q --durations=5

# Real 2-rank Composer trainings (examples/demo.py).
demo: venv-composer
	$(CBIN)/python examples/demo.py

# Regenerates docs/reference.md, docs/failures.md and README.md's failure table; reruns the
# example runs whose recorded output (docs/outputs/) no longer matches the code (each with its
# framework's environment).
docs: venv venv-composer
	$(BIN)/python docs/generate.py

bench: venv venv-composer
	$(BIN)/python benchmarks/overhead.py --frameworks lightning,torch,transformers
	$(CBIN)/python benchmarks/overhead.py --frameworks composer

# Installing rankguard with the extras of each world's frameworks into that world's locked
# environment must change no installed package (pip's dry run reports rankguard alone).
install-check: venv venv-composer
	$(BIN)/python tools/install_check.py --extras lightning,transformers,olmo-core,report
	$(CBIN)/python tools/install_check.py --extras composer,lightning,transformers,olmo-core,streaming,report

# The one deliberate way to move to newer releases: resolves each world's extras in a scratch
# environment and rewrites its lock with what it installed (torch's local build tag dropped).
lock:
	$(MAKE) _lock L=$(LOCK) X='$(EXTRAS)'
	$(MAKE) _lock L=$(LOCK_COMPOSER) X='$(EXTRAS_COMPOSER)'

_lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --upgrade pip setuptools wheel uv
	.venv-lock/bin/python -m pip install '.[$(X)]'
	{ echo "# Exact versions of the environment make creates (pip -c). Refresh: make lock."; \
	  .venv-lock/bin/python -m pip freeze --all | grep -v '^rankguard' | sed 's/+cpu$$//'; } > $(L)
	rm -rf .venv-lock build *.egg-info

clean:
	rm -rf $(VENV) $(VENV_COMPOSER) *.egg-info .pytest_cache
