# Two commands do all the set-up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The exact versions every environment here is built from (docs/dependencies.md); `make lock`
# refreshes them within pyproject.toml's ranges.
LOCK := requirements.lock
LMMS_LOCK := requirements-lmms.lock
# the extras the main lock resolves: every one but lmms, whose PyAV pin has its own lock
LOCK_EXTRAS := --extra dev --extra decord --extra wandb
# A constraint file pip is configured with (a machine whose local wheels cap torch) binds the lock too,
# so that the lock stays installable there.
PIP_CONSTRAINT_FILE = $(shell $(PY) -m pip config list 2>/dev/null \
	| sed -n "s/^[^=]*[.]constraint='\(.*\)'$$/\1/p")
UV_COMPILE = pip compile pyproject.toml --universal --python-version 3.11 --quiet \
	--custom-compile-command "make lock" $(foreach c,$(PIP_CONSTRAINT_FILE),-c $(c))

.PHONY: demo demo-hour test check lint test-latest lock lmms-env decord-env bench results gpu-check \
	install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Everything from a lock ($(2)) into the environment $(1): pip and setuptools, then torch, then
# deepspeed without build isolation (its build imports the installed torch instead of pulling another
# one into an isolated build), then the project with its dev extra (built with the locked
# setuptools, nothing downloaded for the build), and `pip check`.
define install_from
	$(1)/bin/python -m pip install -q -c $(2) pip setuptools
	$(1)/bin/python -m pip install -q -c $(2) torch
	$(1)/bin/python -m pip install -q -c $(2) --no-build-isolation deepspeed
	$(1)/bin/python -m pip install -q -c $(2) --no-build-isolation -e ".[dev]"
	$(1)/bin/python -m pip check
endef

$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(call install_from,$(VENV),$(LOCK))
	touch $(STAMP)

install: $(STAMP)

# The formatter and the linter first ([tool.ruff] in pyproject.toml): a tree they would change fails.
lint: $(STAMP)
	$(BIN)/python -m ruff format --check --quiet .
	$(BIN)/python -m ruff check --quiet .

test: lint
	$(BIN)/python -m pytest -q -x --timeout=900 tests

# The fast loop: everything but the tests marked slow (multi-rank training runs, the demos' plans,
# compiler builds). LONGVIDEO_SUITE_JSON=docs/bench/suite-check.json records its time for the README.
check: lint
	$(BIN)/python -m pytest -q -x --timeout=900 -m "not slow" tests

# Refresh both locks from pyproject.toml's ranges (the newest releases inside them). The lmms lock
# resolves the project with its lmms extra, lmms-eval's PyAV pin overriding ours, starting from the
# main lock's versions (uv keeps an output file's pins where it can): its environment, layered over
# the main one, installs only what lmms-eval needs different.
lock: | $(BIN)/python
	$(BIN)/python -m pip install -q $(if $(wildcard $(LOCK)),-c $(LOCK)) uv
	$(BIN)/python -m uv $(UV_COMPILE) $(LOCK_EXTRAS) --upgrade -o $(LOCK)
	printf 'av<16\n' > $(VENV)/lmms-overrides.txt
	cp $(LOCK) $(LMMS_LOCK)
	$(BIN)/python -m uv $(UV_COMPILE) --extra lmms --override $(VENV)/lmms-overrides.txt \
		-o $(LMMS_LOCK)
	sed -i -e '/^    #   -c /d' -e '/^    # via -c /d' $(LOCK) $(LMMS_LOCK)  # no machine paths

# The environments of the two extras that cannot join the main one, layered over it (each holds
# only what differs): lmms-eval with its PyAV < 16, and decord (whose wheel `pip check` calls
# unsupported). tests/test_lmms.py and tests/test_decord.py build them when needed.
lmms-env: $(STAMP)
	$(BIN)/python tests/sideenv.py lmms

decord-env: $(STAMP)
	$(BIN)/python tests/sideenv.py decord

# Not in CI: the suite on the newest releases pyproject.toml allows, resolved now (not the lock) into
# .venv-latest (its versions.txt lists them). The README records when it last passed.
# LATEST_TESTS="-m 'not slow' tests" runs a part.
LATEST_TESTS ?= tests
test-latest:
	rm -rf .venv-latest
	$(PY) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q "uv>=0.9,<1"
	.venv-latest/bin/python -m uv $(UV_COMPILE) $(LOCK_EXTRAS) --upgrade -o .venv-latest/latest.lock
	$(call install_from,.venv-latest,.venv-latest/latest.lock)
	.venv-latest/bin/python -m pip freeze --exclude-editable > .venv-latest/versions.txt
	.venv-latest/bin/python -m pytest -q -x --timeout=900 $(LATEST_TESTS)

demo: $(STAMP)
	$(BIN)/python -m longvideo.demo

demo-hour: $(STAMP)
	$(BIN)/python -m longvideo.demo --hour

# Every scripts/bench_*.py, then docs/benchmarks.md, docs/results.md and the README's generated blocks.
bench: $(STAMP)
	$(BIN)/python scripts/run_benchmarks.py

# Only the pages and the README's blocks, from docs/bench/*.json (after one script's run, or a demo's
# summary.json copied to docs/bench/demo.json or demo-hour.json).
results: $(STAMP)
	$(BIN)/python scripts/run_benchmarks.py --skip-run

# One run of at most 8 minutes on one GPU (a dry run on tiny shapes without CUDA): every attention
# route vs float64, host syncs, forward and backward vs SDPA-flash and cuDNN, a predicted ring, the
# 135M-shape training step and context vs transformers. Writes docs/bench/gpu_check.json and the
# GPU-check section of docs/benchmarks.md.
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf $(VENV) .venv-* runs outputs
