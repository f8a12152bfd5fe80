"""torch is only the model executor's and the attention package's: the main command, replay
and the API run where importing torch fails, and `--executor model` there says which extra
to install. (CI also installs the project without the `model` extra into a fresh venv:
`make check-no-torch`.) Also the model executor's other refusals before any work: token ids
past the model's vocabulary, and a model too large for the device's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"
BLOCKER = """\
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTorch())
"""


def _run_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_the_blocker_blocks(tmp_path):
    done = _run_without_torch(tmp_path, "-c", "import torch")
    assert done.returncode != 0 and "blocked by the test" in done.stderr


def test_compare_replay_and_the_api_run_without_torch(tmp_path):
    out = tmp_path / "out"
    done = _run_without_torch(tmp_path, "-m", "experiments", "compare", "--workload", "no_sharing", "--knob",
                              "num_requests=8", "--capacity-tokens", "20000", "--no-progress", "--output-dir", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(json.loads((out / "results.json").read_text())["cells"]) == 5
    done = _run_without_torch(tmp_path, "-m", "experiments", "replay", "--backend", "apc", "--trace", str(TRACE),
                              "--limit", "20", "--no-progress")  # fmt: skip
    assert done.returncode == 0 and "hit rate" in done.stdout, done.stderr
    code = (
        "import sys; from experiments import api; import attention; from attention.config import PRESETS; "
        f"r = api.compare(workload='no_sharing', knobs={{'num_requests': 4}}, backend=['apc'], model='tiny', "
        f"capacity_tokens=[20000], output_dir={str(tmp_path / 'api')!r}); "
        "assert 'torch' not in sys.modules and r.rows(); print('ok')"
    )
    done = _run_without_torch(tmp_path, "-c", code)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_the_model_executor_without_torch_names_the_extra(tmp_path):
    done = _run_without_torch(tmp_path, "-m", "experiments", "compare", "--workload", "no_sharing", "--knob",
                              "num_requests=3", "--executor", "model", "--model", "tiny", "--backend", "apc",
                              "--capacity-tokens", "2000", "--output-dir", str(tmp_path / "o"))  # fmt: skip
    assert done.returncode == 3 and "Traceback" not in done.stderr
    assert "--executor model needs torch" in done.stderr and "prefix-cache-lab[model]" in done.stderr
    assert not (tmp_path / "o").exists()


MODEL = ["--executor", "model", "--backend", "apc", "--no-progress", "--no-bounds"]


def test_ids_past_the_vocabulary_name_the_knob(tmp_path, capsys):
    pytest.importorskip("torch")
    argv = ["compare", "--workload", "no_sharing", "--knob", "num_requests=3", "--model", "tiny", *MODEL,
            "--capacity-tokens", "2000", "--output-dir", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "has token ids up to" in err and "vocabulary of 512" in err and "--knob vocab_size=512" in err
    assert not (tmp_path / "o").exists()
    # the knob it names fixes it
    assert main([*argv, "--knob", "vocab_size=512", "--knob", "prompt_len=40", "--knob", "output_len=2"]) == 0
    # a trace has no such knob: the error says what else to do
    trace = ["compare", "--trace", str(TRACE), "--knob", "limit=2", "--model", "tiny", *MODEL,
             "--capacity-tokens", "200000", "--output-dir", str(tmp_path / "t")]  # fmt: skip
    assert main(trace) == 3 and "a model with a larger vocabulary, or --executor cost" in capsys.readouterr().err


def test_a_model_too_large_for_the_device_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    import experiments.runs.model_fit as model_fit

    monkeypatch.setattr(model_fit, "available_bytes", lambda device: 8 * 10**9)  # an 8 GB device
    argv = ["compare", "--workload", "no_sharing", "--knob", "num_requests=2", "--model", "llama3-8b", *MODEL,
            "--capacity-tokens", "20000", "--output-dir", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "--executor model --model llama3-8b needs at least 18.7 GB" in err and "has 8.0 GB available" in err
    assert "16.06 GB of bfloat16 weights" in err and "--model tiny" in err
    assert not (tmp_path / "o").exists()
    weights, kv = model_fit.model_bytes(model_fit.PRESETS["llama3-8b"], 20000)
    assert weights == 8_030_261_248 * 2 and kv == 20000 * 2 * 32 * 8 * 128 * 2  # Llama-3-8B: 8.03 B parameters
