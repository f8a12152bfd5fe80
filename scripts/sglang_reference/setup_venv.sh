#!/usr/bin/env bash
# Build the side venv with the real SGLang 0.5.23 on CPU (outside the repo; never a CUDA torch).
# Usage: scripts/sglang_reference/setup_venv.sh [/work/sglang-venv]
set -euo pipefail
VENV=${1:-/work/sglang-venv}
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
$PIP install torch==2.13.0          # the +cpu build must be what pip finds (local wheelhouse / CPU index)
"$VENV/bin/python" -c "import torch, sys; sys.exit('CUDA torch installed: use the CPU build' if torch.version.cuda else 0)"
$PIP install --no-deps sglang==0.5.23 numpy
$PIP install --no-deps triton==3.9.0   # imported at module level by sglang.srt.utils; no kernel launches on CPU
# small pure-python (or small binary) imports of the sglang.srt import chain, one by one, no deps
$PIP install --no-deps orjson psutil pybase64 requests urllib3 idna certifi packaging pillow \
    starlette anyio msgspec pydantic pydantic_core typing_inspection annotated_types pyzmq \
    tqdm IPython traitlets pygments aiohttp multidict attrs yarl propcache aiohappyeyeballs \
    aiosignal frozenlist transformers==5.19.0 'huggingface_hub>=1.0' httpx2 httpcore2 \
    truststore h11 regex pyyaml 'safetensors>=0.8.0' tokenizers typer 'apache-tvm-ffi==0.1.11' \
    dill sentencepiece compressed_tensors loguru gguf openai==2.8.0 httpx sniffio distro \
    partial_json_parser
# torchvision is NOT installed (the PyPI wheel is a CUDA build): run_sglang.py stubs it.
"$VENV/bin/python" - <<'PY'
import sys; sys.path.insert(0, "scripts/sglang_reference")
import run_sglang; run_sglang.bootstrap_sglang(); print("sglang", run_sglang.SG.version, "imports OK")
PY
