#!/usr/bin/env bash
# Build the side venv with the real vLLM 0.33.0 on CPU (outside the repo; never a CUDA torch).
# Usage: scripts/vllm_reference/setup_venv.sh [/work/vllm-venv]
set -euo pipefail
VENV=${1:-/work/vllm-venv}
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
$PIP install torch==2.13.0          # FIRST; the +cpu build must be what pip finds (local wheelhouse / CPU index)
"$VENV/bin/python" -c "import torch, sys; sys.exit('CUDA torch installed: use the CPU build' if torch.version.cuda else 0)"
$PIP install --no-deps vllm==0.33.0 numpy==2.4.6
# the pure-python (or small binary) import chain of vllm.v1.core.sched.{scheduler,async_scheduler}
# and vllm.v1.engine.core, added one by one as imports demanded, no deps (versions as used):
$PIP install --no-deps aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 cloudpickle==3.1.3 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 llguidance==1.9.1 msgspec==0.23.0 multidict==7.2.1 openai==3.57.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.19.0 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1 
"$VENV/bin/python" - <<'PY'
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine.core import EngineCore
assert torch.version.cuda is None
print("vllm", vllm.__version__, "imports OK on torch", torch.__version__)
PY
