# Two commands do all the set-up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-hour test check bench results gpu-check install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

# torch first (local wheels, pinned), then deepspeed without build isolation so that its
# build step sees the installed torch instead of pulling another one, then the project.
$(STAMP): pyproject.toml $(BIN)/python
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q --no-build-isolation "deepspeed>=0.16"
	$(BIN)/pip install -q -e ".[dev]"
	# the dev extra's lmms-eval asks for PyAV < 16 (PyAV 15.1 crashes the interpreter opening an MPEG-1
	# file, tests/test_data_robust.py) and its wandb for protobuf < 7 (which cannot read the
	# sentencepiece model of LWM's tokenizer); the lmms-eval model uses neither: keep the newer ones
	$(BIN)/pip install -q "av>=16" "protobuf>=7"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=900 tests

# The fast loop: everything but the tests marked slow (multi-rank training runs, the demos' plans,
# compiler builds). LONGVIDEO_SUITE_JSON=docs/bench/suite-check.json records its time for the README.
check: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=900 -m "not slow" tests

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
	rm -rf $(VENV) runs outputs
