# `make setup` builds .venv: torch first (TORCH, default torch==2.13.0, with PyTorch's CPU
# wheel index as an extra index, where pip finds 2.13.0+cpu and prefers it to PyPI's CUDA
# build; choose another: make setup TORCH='torch==2.6.0' TORCH_INDEX=https://download.pytorch.org/whl/cu124,
# or TORCH_INDEX= for plain PyPI; one retry only, so an index that cannot be reached costs
# seconds, not minutes), then the project with every extra the suite tests (the
# ray extra, about 80 MB, lets it run `sweep --ray local`; the fast extra, numba, about 210 MB,
# compiles apc's hash chains). torch is only the `model` extra: `make check-no-torch`
# installs the project without it (and without numba) into a fresh venv and runs it.
# `make compare` is the main job (every backend on the default workload, report in
# reports/latest/); `make test` runs lint and the suite (what CI runs), `make test-all` the
# slow cases too.
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

.PHONY: setup test test-all compare replay mooncake tiers zoo calibration bench lint clean check-no-torch

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 1)
	$(BIN)/pip install -q -e '.[dev,ray,model,tokenizers,pandas,fast]'
	touch $(STAMP)

# the suite in parallel (pytest-xdist), lint first; slow cases (marked `slow`) wait for test-all
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n auto

# everything, slow cases included (the GPU cases skip without CUDA)
test-all: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n auto -m "not gpu"

compare: setup
	$(BIN)/python -m experiments compare --output-dir reports/latest

replay: setup
	$(BIN)/python -m experiments replay --backend apc --trace experiments/data/mooncake_conversation_2000.jsonl --capacity-tokens 200000 --output reports/latest/replay_apc.json

# the full Mooncake conversation trace (TRACE=path; see above), all backends
mooncake: setup
	@test -f '$(TRACE)' || { echo "no trace at $(TRACE): download conversation_trace.jsonl from the Mooncake repository (FAST25-release/traces/) and give TRACE=path"; exit 1; }
	$(BIN)/python -m experiments compare --trace $(TRACE) --capacity-tokens 200000 1000000 3000000 10000000 --force-capacity --jobs 2 --output-dir reports/mooncake

# memory tiers on the full trace (reports/tiers, reports/tiers-cluster): GPU 1M tokens with no
# host tier, a 4M and a 16M host tier under every tiered design, storage below the host, and a
# 2-replica cluster sharing one storage pool
H4 := host_capacity_tokens=4000000
H16 := host_capacity_tokens=16000000
# one variable per design, joined without spaces (a backend list is one shell word)
TIERS_NONE := apc,radix
TIERS_OFFLOAD := apc[$(H4)],apc[$(H16)],apc[$(H4),host_eviction=arc],apc[$(H16),host_eviction=arc]
TIERS_HICACHE := radix-hicache[$(H4)],radix-hicache[$(H16)]
TIERS_SELECTIVE := radix-hicache[$(H4),write_policy=write_through_selective],radix-hicache[$(H16),write_policy=write_through_selective]
TIERS_BACK := radix-hicache[$(H4),write_policy=write_back],radix-hicache[$(H16),write_policy=write_back]
TIERS_LMCACHE := apc-lmcache[$(H4)],apc-lmcache[$(H16)]
L3 := storage_capacity_tokens=64000000
TIERS_STORAGE := radix-hicache[$(H4),storage_backend=file,$(L3)],apc-lmcache[$(H4),disk_capacity_tokens=64000000]
TIER_BACKENDS := $(TIERS_NONE),$(TIERS_OFFLOAD),$(TIERS_HICACHE),$(TIERS_SELECTIVE),$(TIERS_BACK),$(TIERS_LMCACHE),$(TIERS_STORAGE)
TIER_CLUSTER_BACKENDS := radix,radix-hicache[$(H4)],radix-hicache[$(H4),storage_backend=file,$(L3)],radix-hicache[$(H4),storage_backend=shared,$(L3)]
tiers: setup
	@test -f '$(TRACE)' || { echo "no trace at $(TRACE): download conversation_trace.jsonl from the Mooncake repository (FAST25-release/traces/) and give TRACE=path"; exit 1; }
	$(BIN)/python -m experiments compare --trace $(TRACE) --capacity-tokens 1000000 --force-capacity --backend '$(TIER_BACKENDS)' --jobs 2 --no-progress --output-dir reports/tiers
	$(BIN)/python -m experiments compare --trace $(TRACE) --capacity-tokens 1000000 --force-capacity --replicas 2 --router cache_aware --backend '$(TIER_CLUSTER_BACKENDS)' --jobs 2 --no-progress --output-dir reports/tiers-cluster

# the timing models against every measured source available offline (docs/timing.md)
calibration: setup
	$(BIN)/python -m experiments.timing.calibration --output-dir reports/calibration

# the zoo on the full trace: Llama-3-70B on 4 A100s timed by vidur's measured profile, and the
# mixture of experts Mixtral-8x7B on 2 H200s by the roofline, each at vLLM's 0.9 of memory
zoo: setup
	@test -f '$(TRACE)' || { echo "no trace at $(TRACE): download conversation_trace.jsonl from the Mooncake repository (FAST25-release/traces/) and give TRACE=path"; exit 1; }
	$(BIN)/python -m experiments compare --trace $(TRACE) --model llama3-70b --tp 4 --device a100 --executor profile --gpu-memory-utilization 0.9 --backend apc,radix --protocol serving --jobs 2 --no-progress --output-dir reports/zoo/llama3-70b-tp4-a100
	$(BIN)/python -m experiments compare --trace $(TRACE) --model mixtral-8x7b --tp 2 --device h200 --gpu-memory-utilization 0.9 --backend apc,radix --protocol serving --jobs 2 --no-progress --output-dir reports/zoo/mixtral-8x7b-tp2-h200

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
