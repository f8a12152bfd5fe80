# `make setup` builds .venv (CPU torch pinned first, so pip never pulls a CUDA build);
# the ray extra (about 80 MB, seconds to install) lets the suite run `sweep --ray local`.
# `make compare` is the main job (every backend on the default workload, report in
# reports/latest/); `make test` runs the suite (what CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TRACE ?= ../shared/traces/mooncake/conversation_trace.jsonl

.PHONY: setup test compare replay mooncake bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,plots,ray]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest

compare: setup
	$(BIN)/python -m experiments compare --output-dir reports/latest

replay: setup
	$(BIN)/python -m experiments replay --backend apc --trace experiments/data/mooncake_conversation_2000.jsonl --capacity-tokens 200000 --output reports/latest/replay_apc.json

# the full Mooncake conversation trace (in ../shared beside the checkout), all backends
mooncake: setup
	$(BIN)/python -m experiments compare --trace $(TRACE) --capacity-tokens 200000 1000000 3000000 10000000 --jobs 2 --output-dir reports/mooncake

bench: setup
	$(BIN)/python -m experiments.bench.replay_bench --backend apc radix --output reports/bench/replay_bench.json

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
