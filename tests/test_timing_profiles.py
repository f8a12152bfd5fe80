"""The model zoo, measured step profiles and the profile executor (experiments/timing/)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.engine.executors import CostModelExecutor, ModelShape, device_profile, llama3_8b_shape
from experiments.timing.profile import ProfileError, load_profile, parse_profile, shipped_profile, shipped_profiles
from experiments.timing.profile_executor import ProfileExecutor
from experiments.timing.zoo import MODELS, ZooError, resolve_gpu, resolve_model

HEADER = "# model: llama3-8b\n# device: a100\n# source: test\n# engine: none\n# license: CC0\n"


def table(rows: str, header: str = HEADER) -> str:
    return header + "op,tp,tokens,context,ms\n" + rows


# -- the zoo ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama3-8b", 8_030_261_248),  # the model cards' counts
        ("llama3-70b", 70_553_706_496),
        ("llama2-7b", 6_738_415_616),
        ("llama2-70b", 68_976_648_192),
        ("qwen2.5-7b", 7_615_616_512),
        ("mixtral-8x7b", 46_702_792_704),
    ],
)
def test_parameter_counts_are_the_published_ones(name, params):
    assert MODELS[name].num_params() == params


def test_a_mixture_runs_a_fraction_of_its_weights():
    m = MODELS["mixtral-8x7b"]
    assert 12.5e9 < m.matmul_params(active=True) < 13.0e9  # Mixtral's "12.9B active" with embeddings
    assert m.matmul_params(active=False) > 3 * m.matmul_params(active=True)


def test_hugging_face_ids_and_gpu_spellings_are_aliases():
    assert resolve_model("meta-llama/Meta-Llama-3-8B").name == "llama3-8b"
    assert resolve_model("Meta-Llama-3-70B").name == "llama3-70b"
    assert resolve_gpu("A100_80GB").name == "a100"
    assert resolve_gpu("a100-40gb").name == "a100-40gb"
    assert resolve_gpu("NVIDIA-H100").name == "h100"
    with pytest.raises(ZooError, match="unknown model 'gpt-5'.*llama3-8b"):
        resolve_model("gpt-5")
    with pytest.raises(ZooError, match="unknown GPU 'v100'"):
        resolve_gpu("v100")


def test_tensor_parallel_shards_as_vllm_does():
    m = MODELS["llama3-70b"]
    assert m.kv_heads_per_gpu(4) == 2
    assert m.kv_bytes_per_token(4) == m.kv_bytes_per_token() // 4
    shape = ModelShape.from_spec(m, 4)
    assert shape.kv_bytes_per_token == m.kv_bytes_per_token(4)
    assert abs(shape.weight_bytes - m.num_params() * 2 / 4) < 1e7  # all but the norms split
    # more GPUs than KV heads: each GPU keeps one (replicated), so KV per GPU stops shrinking
    assert m.kv_heads_per_gpu(16) == 1
    with pytest.raises(ZooError, match="does not divide llama3-70b's 64 attention heads"):
        m.check_tp(3)
    with pytest.raises(ZooError, match="positive integer"):
        m.check_tp(0)
    with pytest.raises(ZooError, match="neither divides"):
        MODELS["qwen2.5-7b"].check_tp(14)  # 28 heads, 4 KV heads: 14 divides the one, not the other


def test_llama3_8b_on_one_gpu_is_the_shape_the_cost_model_always_had():
    s = llama3_8b_shape()
    assert (s.num_params, s.embedding_params, s.kv_bytes_per_token) == (
        8_030_261_248 - 128256 * 4096,
        128256 * 4096,
        131072,
    )
    assert s.weights_read(7) == s.num_params * 2 and s.tp == 1
    ex = CostModelExecutor(s, "h200")
    assert ex.all_reduce_seconds(4096) == 0.0


def test_tensor_parallel_divides_the_work_and_adds_communication():
    spec = MODELS["llama3-70b"]
    one, four = (CostModelExecutor(ModelShape.from_spec(spec, tp), "h100") for tp in (1, 4))
    new, starts = np.array([2048]), np.array([0])
    assert four.all_reduce_seconds(2048) > 0
    assert four.batch_seconds(new, starts) < one.batch_seconds(new, starts) / 3  # a quarter, plus the all-reduces
    assert four.batch_seconds(new, starts) > one.batch_seconds(new, starts) / 4


def test_a_mixture_reads_more_experts_as_the_batch_grows():
    s = ModelShape.from_spec(MODELS["mixtral-8x7b"])
    reads = [s.weights_read(t) for t in (1, 2, 8, 64)]
    assert reads == sorted(reads)
    assert reads[-1] == pytest.approx(s.weight_bytes - s.embedding_params * 2, rel=1e-6)  # every expert touched


# -- the table format ---------------------------------------------------------------------------


def test_every_shipped_table_loads_and_names_its_source():
    tables = shipped_profiles()
    assert ("llama3-8b", "a100") in tables and ("llama3-70b", "a100") in tables and ("llama2-70b", "h100") in tables
    for path in tables.values():
        p = load_profile(path)
        assert "vidur" in p.header["source"] and p.header["license"].startswith("MIT")
        assert p.degrees == [1, 2, 4, 8]
        assert all(tp in p.all_reduce for tp in (2, 4, 8))


@pytest.mark.parametrize(("model", "device"), sorted(shipped_profiles()))
def test_a_shipped_profile_replays_its_own_grid_and_predicts_held_out_points(model, device):
    p = shipped_profile(model, device)
    for tp, curve in p.linear.items():
        assert np.allclose(curve(curve.x), curve.y, rtol=0.02)  # its own grid, within 2% (exactly, in fact)
        # every other point held out, the rest interpolated: the median error on the held-out ones
        from experiments.timing.calibration import held_out

        _, measured, predicted = held_out(curve)
        err = np.abs(predicted - measured) / measured
        assert np.median(err) <= 0.10, (tp, np.median(err))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("linear,1,1,0,0.1\n", "interpolation needs at least 2"),
        ("linear,1,1,0,0.1\nlinear,1,1,0,0.2\n", "line 8: a second linear row at tp 1, tokens 1"),
        ("linear,1,1,0,0.1\nconv,1,2,0,0.2\n", "line 8: unknown op 'conv' in column op"),
        ("linear,1,1,0,0.1\nlinear,1,two,0,0.2\n", "line 8: column tokens must be a whole number, got 'two'"),
        ("linear,1,1,0,0.1\nlinear,1,2,0,-1\n", "line 8: column ms must be a positive, finite time"),
        ("linear,1,1,0,0.1\nlinear,1,2,0,nan\n", "line 8: column ms must be a positive, finite time"),
        ("linear,1,1,0,0.1\nlinear,1,2,5,0.2\n", "line 8: column context must be 0 for linear rows"),
        ("linear,1,1,0,0.1\nlinear,1,2,0\n", "line 8: 4 fields"),
        ("all_reduce,2,1,0,0.1\nall_reduce,2,2,0,0.1\n", "no linear rows"),
        (
            "linear,1,1,0,0.1\nlinear,1,2,0,0.2\nattn_decode,1,1,10,0.1\nattn_decode,1,2,20,0.1\n",
            "not a full grid: no row at tokens 1, context 20",
        ),
    ],
)
def test_a_bad_table_is_refused_naming_the_line_or_column(rows, message):
    with pytest.raises(ProfileError, match=message):
        parse_profile(table(rows), "t.csv")


def test_a_table_without_provenance_or_with_other_columns_is_refused():
    with pytest.raises(ProfileError, match="the header lacks # license"):
        parse_profile(table("linear,1,1,0,0.1\nlinear,1,2,0,0.2\n", HEADER.replace("# license: CC0\n", "")), "t.csv")
    with pytest.raises(ProfileError, match="must be the columns op,tp,tokens,context,ms"):
        parse_profile(HEADER + "op,tokens,ms\nlinear,1,0.1\n", "t.csv")
    with pytest.raises(ProfileError, match="unknown model 'gpt-5'"):
        parse_profile(table("linear,1,1,0,0.1\n", HEADER.replace("llama3-8b", "gpt-5")), "t.csv")
    with pytest.raises(ProfileError, match="cannot be read"):
        load_profile("/nonexistent/profile.csv")


def test_a_missing_shipped_profile_names_those_there_are():
    with pytest.raises(
        ProfileError, match="no shipped profile for mixtral-8x7b on h200.*llama3-8b on a100.*--profile FILE"
    ):
        shipped_profile("mixtral-8x7b", "h200")


# -- the executor -------------------------------------------------------------------------------


def test_the_profile_executor_composes_a_step_from_its_parts():
    p = parse_profile(table("linear,1,1,0,0.1\nlinear,1,101,0,1.1\n"), "t.csv")
    ex = ProfileExecutor(p, device_profile("a100"))
    parts = ex.parts(np.array([50, 0, 1]), np.array([0, 7, 300]))
    assert parts["linear"] == pytest.approx(32 * 0.6 / 1e3)  # 51 tokens: halfway between the points, per layer x 32
    assert parts["all_reduce"] == 0.0 and parts["attention"] > 0
    assert ex.batch_seconds(np.array([50, 0, 1]), np.array([0, 7, 300])) == pytest.approx(sum(parts.values()))
    assert "attention and LM head from the roofline" in ex.describe()
    # past the last point: along the last segment
    assert ex.parts(np.array([201]), np.array([0]))["linear"] == pytest.approx(32 * 2.1 / 1e3)


def test_measured_attention_rows_are_used_where_the_table_has_them():
    rows = "linear,1,1,0,0.1\nlinear,1,101,0,1.1\n" + "".join(
        f"attn_decode,1,{b},{c},{0.001 * b * c / 100:.6f}\n" for b in (1, 64) for c in (100, 10000)
    )
    ex = ProfileExecutor(parse_profile(table(rows), "t.csv"), device_profile("a100"))
    ms = ex.attention_ms(np.ones(64, dtype=np.int64), np.full(64, 9999))
    assert ms == pytest.approx(0.001 * 64 * 10000 / 100)
    assert "attention measured" in ex.describe().replace("linear, attention", "attention")


def test_decode_windows_price_each_step_as_one_step_would():
    ex = ProfileExecutor(shipped_profile("llama3-70b", "a100"), device_profile("a100"), 4)
    contexts = np.arange(1, 65, dtype=np.int64) * 100
    window = ex.decode_step_seconds(contexts, 6)
    one_by_one = [ex.batch_seconds(np.ones(64, dtype=np.int64), contexts + j) for j in range(6)]
    assert np.allclose(window, one_by_one, rtol=1e-12)


def test_the_profile_executor_refuses_what_its_table_cannot_time():
    p = shipped_profile("llama3-8b", "a100")
    with pytest.raises(ProfileError, match="measured on a100, but the run is on h100"):
        ProfileExecutor(p, device_profile("h100"))
    with pytest.raises(ProfileError, match="measured for llama3-8b, but the run's model is llama3-70b"):
        ProfileExecutor(p, device_profile("a100"), model="meta-llama/Meta-Llama-3-70B")
    one_degree = parse_profile(table("linear,1,1,0,0.1\nlinear,1,2,0,0.2\n"), "t.csv")
    with pytest.raises(ProfileError, match="no linear rows at tp 2"):
        ProfileExecutor(one_degree, device_profile("a100"), 2)
    no_comm = parse_profile(table("linear,2,1,0,0.1\nlinear,2,2,0,0.2\n"), "t.csv")
    with pytest.raises(ProfileError, match="no all_reduce rows at tp 2"):
        ProfileExecutor(no_comm, device_profile("a100"), 2)
    with pytest.raises(ZooError, match="does not divide"):
        ProfileExecutor(p, device_profile("a100"), 3)


# -- FP8 weights and the Dynamo source ----------------------------------------------------------


def test_fp8_weights_take_a_byte_and_run_at_the_fp8_rate_where_the_gpu_has_one():
    fp8, bf16 = (ModelShape.from_spec(MODELS[n]) for n in ("llama3.1-8b-fp8", "llama3-8b"))
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token  # the KV stays bf16
    assert fp8.weight_bytes * 2 == bf16.weight_bytes
    on_h200, on_a100 = CostModelExecutor(fp8, "h200"), CostModelExecutor(fp8, "a100")
    assert on_h200.matmul_scale == pytest.approx(0.5, rel=1e-3) and on_a100.matmul_scale == 1.0  # A100: no FP8 cores
    assert CostModelExecutor(bf16, "h200").matmul_scale == 1.0
    prefill = (np.array([8192]), np.array([0]))
    assert on_h200.batch_seconds(*prefill) < CostModelExecutor(bf16, "h200").batch_seconds(*prefill) * 0.6


def test_calibration_reports_every_source_with_its_errors():
    from experiments.timing.calibration import calibrate

    result = calibrate()
    names = {(s["source"], s["timing_model"]) for s in result["sources"]}
    assert {("vidur-linear", "roofline"), ("vidur-linear", "profile"), ("dynamo-h200-decode", "roofline")} <= names
    for s in result["sources"]:
        assert s["points"] > 0 and 0 <= s["median_abs_pct_error"] <= s["p90_abs_pct_error"]
    dynamo = next(s for s in result["sources"] if s["source"] == "dynamo-h200-prefill")
    assert len(dynamo["measured_ms"]) == len(dynamo["predicted_ms"]) == 17


def test_a_measured_profile_is_written_in_the_shipped_format_and_times_a_step(tmp_path):
    pytest.importorskip("torch")
    from experiments.timing.measure import main as measure

    out = tmp_path / "llama2-7b__cpu.csv"
    assert (
        measure(
            ["--model", "llama2-7b", "--device", "cpu", "--tokens", "1", "2", "--repeats", "1", "--output", str(out)]
        )
        == 0
    )
    p = load_profile(out)
    assert p.device == "cpu" and p.model.name == "llama2-7b" and "measure.py" in p.header["source"]
    ex = ProfileExecutor(p, device_profile("cpu"))
    assert ex.batch_seconds(np.array([2]), np.array([0])) > 0
    assert measure(
        ["--model", "llama2-7b", "--device", "h100", "--tokens", "1", "2", "--output", str(tmp_path / "x.csv")]
    ) in (0, 3)
    assert (
        measure(["--model", "llama2-7b", "--device", "cpu", "--tokens", "1", "--output", str(tmp_path / "y.csv")]) == 3
    )
    assert not (tmp_path / "y.csv").exists()
