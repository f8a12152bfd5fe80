# `make setup` builds .venv (CPU torch pinned first, so pip never pulls a CUDA build);
# the ray extra (about 80 MB, seconds to install) lets the suite run `sweep --ray local`;
# `make test` runs the suite; `make replay` runs the main job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test replay bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,plots,ray]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest

replay: setup
	$(BIN)/python -m experiments replay --backend apc --trace experiments/data/mooncake_conversation_2000.jsonl --capacity-tokens 200000 --output reports/latest/replay_apc.json

bench: setup
	$(BIN)/python -m experiments.bench.replay_bench --output reports/bench/replay_bench.json

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
