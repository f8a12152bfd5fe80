# `make setup` builds .venv: torch first (TORCH, default torch==2.13.0, with PyTorch's CPU
# wheel index as an extra index, where pip finds 2.13.0+cpu and prefers it to PyPI's CUDA
# build; choose another: make setup TORCH='torch==2.6.0' TORCH_INDEX=https://download.pytorch.org/whl/cu124,
# or TORCH_INDEX= for plain PyPI; one retry only, so an index that cannot be reached costs
# seconds, not minutes), then the project with every extra the suite tests (the
# ray extra, about 80 MB, lets it run `sweep --ray local`). torch is only the `model` extra:
# `make check-no-torch` installs the project without it into a fresh venv and runs it.
# `make compare` is the main job (every backend on the default workload, report in
# reports/latest/); `make test` runs the suite (what CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# the full Mooncake conversation trace: conversation_trace.jsonl of the FAST'25 release in the
# public Mooncake repository (github.com/kvcache-ai/Mooncake, FAST25-release/traces/)
TRACE ?= traces/conversation_trace.jsonl
NOTORCH := .venv-notorch

.PHONY: setup test compare replay mooncake bench lint clean check-no-torch

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 1)
	$(BIN)/pip install -q -e '.[dev,ray,model,tokenizers,pandas]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest

compare: setup
	$(BIN)/python -m experiments compare --output-dir reports/latest

replay: setup
	$(BIN)/python -m experiments replay --backend apc --trace experiments/data/mooncake_conversation_2000.jsonl --capacity-tokens 200000 --output reports/latest/replay_apc.json

# the full Mooncake conversation trace (TRACE=path; see above), all backends
mooncake: setup
	@test -f '$(TRACE)' || { echo "no trace at $(TRACE): download conversation_trace.jsonl from the Mooncake repository (FAST25-release/traces/) and give TRACE=path"; exit 1; }
	$(BIN)/python -m experiments compare --trace $(TRACE) --capacity-tokens 200000 1000000 3000000 10000000 --jobs 2 --output-dir reports/mooncake

bench: setup
	$(BIN)/python -m experiments.bench.replay_bench --backend apc radix --output bench-results/replay_bench.json

lint: setup
	$(BIN)/ruff check .

# the main command without torch: a fresh venv with the project and no extra (seconds)
check-no-torch:
	rm -rf $(NOTORCH)
	$(PY) -m venv $(NOTORCH)
	$(NOTORCH)/bin/pip install -q -e .
	$(NOTORCH)/bin/python -c "import importlib.util, sys; sys.exit('torch is installed' if importlib.util.find_spec('torch') else 0)"
	$(NOTORCH)/bin/python -m experiments compare --workload no_sharing --knob num_requests=20 --capacity-tokens 20000 --no-progress --output-dir $(NOTORCH)/out
	$(NOTORCH)/bin/python -m experiments replay --backend apc --trace experiments/data/mooncake_conversation_2000.jsonl --limit 50 --no-progress

clean:
	rm -rf $(VENV) $(NOTORCH) .pytest_cache .hypothesis
