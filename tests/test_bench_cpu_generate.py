"""benchmarks/cpu_generate.py's pure parts, without running a model: the bytes a decode step reads from a tiny
ONNX model's initializers, the floor arithmetic, the row / pair assembly and the results schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench_modules import bench_module

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    with bench_module("cpu_generate") as mod:
        yield mod


def _init(name, shape, dtype):
    return numpy_helper.from_array(np.zeros(shape, dtype), name)


def tiny_model() -> onnx.ModelProto:
    """Every way a weight reaches a MatMul or a Gather in the engines' graphs, vocab 10, hidden 4.

    counted whole (matmul): w1 [4,6] f32 = 96; w2t [3,6] f32 through a Transpose = 72; a Constant w3 [3,5] f32 = 60;
    the tied table emb [10,4] f16 as Gemm(transB) lm_head = 80; MatMulNBits B [8,1,16] u8 = 128 + scales [8] f32 = 32;
    one row: emb 80 / 10 = 8; GatherBlockQuantized q [10,1,2] u8 through a Reshape 20 / 10 = 2 + its scales
    [10,1] f32 40 / 10 = 4. Not counted: the norm weight, the Reshape's shape."""
    inits = [_init("emb", (10, 4), np.float16), _init("w1", (4, 6), np.float32), _init("norm", (6,), np.float32),
             _init("w2t", (3, 6), np.float32), _init("nb_b", (8, 1, 16), np.uint8), _init("nb_s", (8,), np.float32),
             _init("q", (10, 1, 2), np.uint8), _init("q_shape", (2,), np.int64), _init("q_s", (10, 1), np.float32)]
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["h16"]),
        helper.make_node("Cast", ["h16"], ["h"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["h", "w1"], ["a"]),
        helper.make_node("Mul", ["a", "norm"], ["b"]),
        helper.make_node("Transpose", ["w2t"], ["w2"], perm=[1, 0]),
        helper.make_node("MatMul", ["b", "w2"], ["c"]),
        helper.make_node("Constant", [], ["w3"], value=_init("w3_value", (3, 5), np.float32)),
        helper.make_node("MatMul", ["c", "w3"], ["d"]),
        helper.make_node("Gemm", ["h16", "emb"], ["logits"], transB=1),
        helper.make_node("MatMulNBits", ["h", "nb_b", "nb_s"], ["e"], domain="com.microsoft", K=4, N=8, bits=4,
                         block_size=16),
        helper.make_node("Reshape", ["q", "q_shape"], ["q2"]),
        helper.make_node("GatherBlockQuantized", ["q2", "ids", "q_s"], ["g"], domain="com.microsoft", bits=4,
                         block_size=4),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("d", "e", "g")]
        + [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, None)], initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_weight_bytes_from_initializers(bench):
    got = bench.onnx_weight_bytes(tiny_model(), vocab_size=10)
    assert got["matmul"] == 96 + 72 + 60 + 80 + 128 + 32
    assert got["embedding_row"] == 8 + 2 + 4
    assert got["total"] == got["matmul"] + got["embedding_row"]
    assert got["matmul_initializers"] == 6
    assert bench.onnx_weight_bytes(tiny_model()) == got  # vocab unknown: the largest dimension is the gathered one


def test_weight_bytes_from_a_saved_file_without_its_external_data(bench, tmp_path):
    model = tiny_model()
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    (tmp_path / "m.onnx.data").unlink()  # only the initializers' dims and types are read
    assert bench.onnx_weight_bytes(tmp_path / "m.onnx", 10) == bench.onnx_weight_bytes(model, 10)


def test_model_folder_bytes_read_the_cache_type_from_the_graph(bench, tmp_path):
    model = tiny_model()
    model.graph.input.append(helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT16,
                                                           ["num_blocks", "block_size", 2, 4]))
    onnx.save(model, tmp_path / "model.onnx")
    cfg = {"model": {"vocab_size": 10, "decoder": {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_size": 4,
                                                    "inputs": {"past_key_names": "past_key_values.%d.key"}}}}
    (tmp_path / "genai_config.json").write_text(json.dumps(cfg))
    got = bench.onnx_model_bytes(tmp_path)
    assert got["kv_bytes_per_token"] == 3 * 2 * 2 * 4 * 2  # layers * (K, V) * heads * head_size * fp16
    assert got["kv_dtype"] == "float16" and got["weights"]["total"] == 468 + 14


def test_floor_arithmetic(bench):
    assert bench.mean_decode_context(61, 128) == 125  # steps 1..127 attend to 62..188 positions
    assert bench.mean_decode_context(61, 128) == np.mean([61 + k for k in range(1, 128)])
    assert bench.kv_bytes_per_token(30, 3, 64, 4) == 30 * 2 * 3 * 64 * 4
    assert bench.decode_step_bytes(1e9, 1e3, 100) == 1e9 + 1e5
    assert bench.floor_tok_s(10, 1e9, 1e3, 100) == pytest.approx(10e9 / (1e9 + 1e5))
    # a batch reads the weights once and every sequence's K/V: aggregate tokens/s
    assert bench.floor_tok_s(10, 1e9, 1e3, 100, batch=8) == pytest.approx(8 * 10e9 / (1e9 + 8e5))
    assert bench.floor_tok_s(10, 0, 1e3, 100, batch=8) == pytest.approx(bench.floor_tok_s(10, 0, 1e3, 100))


def test_torch_weight_bytes_count_a_tied_head_whole_and_one_embedding_row(bench):
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.lin = torch.nn.Linear(4, 6)
            self.norm = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    got = bench.torch_weight_bytes(Tiny())
    assert got == {"matmul": (24 + 6 + 40) * 4, "embedding_row": 16, "total": 70 * 4 + 16, "other_parameters": 32}


def _raw(name, status="ok", ttft=500.0, decode=10.0, tokens=(1, 2, 3, 4), **kw):
    row = {"name": name, "engine": name.split("-")[0], "model": kw.pop("model", name), "batch": kw.pop("batch", 1),
           "status": status}
    if status == "ok":
        row |= {"ttft_ms": ttft, "decode_tok_s": decode, "peak_rss_mb": 800.0, "tokens": list(tokens)}
    else:
        row["reason"] = kw.pop("reason", "why")
    return row | kw


def fake_doc(bench) -> dict:
    mb = {"weights": {"matmul": 5.4e8, "embedding_row": 2304, "total": 5.4e8 + 2304}, "kv_bytes_per_token": 46080.0}
    raw = [_raw("hf-fp32", ttft=300, decode=20, model_bytes=mb),
           _raw("genai-fp32", ttft=500, decode=10),
           _raw("pagedkit-fp32", ttft=450, decode=11, tokens=(1, 2, 9, 9), model="export-fp32", peak_rss_mb=840.0),
           _raw("genai-int4", ttft=200, decode=50),
           _raw("pagedkit-int4", ttft=300, decode=20, model="export-int4"),
           _raw("pagedkit-fp32-int4", "skipped", reason="paged-export has no --dtype fp32 yet"),
           _raw("pagedkit-on-genai-int4", "failed", reason="NotImplementedError: GatherBlockQuantized"),
           _raw("pagedkit-fp16", ttft=450, decode=5, model="export-fp16")]
    model_bytes = {"genai-fp32": mb, "export-fp32": mb | {"kv_bytes_per_token": 23040.0}}
    rows = bench.build_rows(raw, model_bytes, 27.0, 61, 128)
    return {"schema": bench.SCHEMA_VERSION, "benchmark": "cpu_generate", "command": "python x", "date": "2026",
            "machine": {"platform": "Linux", "cpu_model": "cpu", "cores": 2}, "threads": 2, "reps": 3,
            "max_new_tokens": 128, "prompt_tokens": 61, "batch": 8, "versions": {}, "bandwidth": {"gb_s": 27.0},
            "rows": rows, "pairs": bench.pair_results({r["name"]: r for r in rows})}


def test_rows_pairs_and_schema_of_a_fake_run(bench):
    doc = fake_doc(bench)
    assert bench.validate_results(doc) == []
    assert bench.validate_results(json.loads(json.dumps(doc))) == []  # JSON-serializable as written
    rows = {r["name"]: r for r in doc["rows"]}
    ctx = 61 + 64
    assert rows["genai-fp32"]["floor_tok_s"] == pytest.approx(27e9 / (5.4e8 + 2304 + 46080 * ctx))
    assert rows["pagedkit-fp32"]["floor_tok_s"] == pytest.approx(27e9 / (5.4e8 + 2304 + 23040 * ctx))
    assert rows["hf-fp32"]["floor_tok_s"] == rows["genai-fp32"]["floor_tok_s"]  # the child's bytes
    assert rows["genai-fp32"]["floor_fraction"] == pytest.approx(10 / rows["genai-fp32"]["floor_tok_s"])
    assert rows["genai-int4"]["floor_tok_s"] is None  # no bytes known: no floor, no fraction
    assert rows["pagedkit-fp32"]["tokens_matching_hf"] == 2 and rows["genai-fp32"]["tokens_matching_hf"] == 4
    pairs = {(p["pagedkit"], p["genai"]): p for p in doc["pairs"]}
    fp32 = pairs[("pagedkit-fp32", "genai-fp32")]
    assert fp32["decode_ratio"] == pytest.approx(1.1) and fp32["ttft_ratio"] == pytest.approx(0.9)
    assert fp32["rss_ratio"] == pytest.approx(840 / 800)
    assert fp32["checks"] == {"decode >= 1x": True, "ttft <= 1x": True, "peak RSS <= 1.1x": True}
    assert fp32["pass"] is True and fp32["matching_prefix_tokens"] == 2
    int4 = pairs[("pagedkit-int4", "genai-int4")]  # reported only (fp16 activations against fp32)
    assert int4["decode_ratio"] == pytest.approx(0.4) and int4["pass"] is None and not int4["must_hold"]
    default = pairs[("pagedkit-fp16", "pagedkit-fp32")]  # the README's default path against the best float row
    assert default["decode_ratio"] == pytest.approx(5 / 11) and default["pass"] is False
    skipped = pairs[("pagedkit-fp32-int4", "genai-int4")]
    assert skipped["pass"] is None and "pagedkit-fp32-int4: skipped" in skipped["reason"]
    assert pairs[("pagedkit-fp32-batch", "genai-fp32-batch")]["reason"].count("not selected") == 2
    text = "\n".join(bench.table_lines(doc["rows"]) + bench.pair_lines(doc["pairs"]))
    assert "SKIPPED: paged-export has no --dtype fp32 yet" in text and "FAILED: NotImplementedError" in text
    assert "ttft <= 1x PASS" in text and "decode >= 0.9x FAIL" in text and "peak RSS 1.05x" in text


def test_schema_problems_are_named(bench):
    doc = fake_doc(bench)
    del doc["bandwidth"]
    doc["rows"][1]["status"] = "fine"
    doc["rows"][2]["ttft_ms"] = None
    doc["rows"][5].pop("reason")
    del doc["rows"][0]["floor_tok_s"]
    errs = bench.validate_results(doc)
    assert "missing top-level key 'bandwidth'" in errs
    assert any("genai-fp32: status 'fine'" in e for e in errs)
    assert any("pagedkit-fp32: ttft_ms should be a number" in e for e in errs)
    assert any("pagedkit-fp32-int4: status skipped without a reason" in e for e in errs)
    assert any("hf-fp32: missing 'floor_tok_s'" in e for e in errs)


def test_rows_pairs_and_models_are_consistent(bench):
    for row in bench.ROWS.values():
        assert row.model in bench.MODELS and row.engine in bench.ENGINES
    for pair in bench.PAIRS:
        assert pair.pagedkit in bench.ROWS and pair.genai in bench.ROWS
        assert bench.ROWS[pair.pagedkit].batched == bench.ROWS[pair.genai].batched
    must = {(p.pagedkit, p.genai): (p.min_decode, p.max_ttft) for p in bench.PAIRS if p.must_hold}
    assert must[("pagedkit-fp32", "genai-fp32")] == (1.0, 1.0)  # issue 38's must-holds
    assert must[("pagedkit-fp32-int4", "genai-int4")] == (1.0, 1.0)
    assert must[("pagedkit-fp32-int4", "llamacpp-q4")] == (1.2, None)
    assert must[("pagedkit-fp16", "pagedkit-fp32")] == (0.9, None)
    assert {p.max_rss for p in bench.PAIRS if p.genai in ("genai-fp32", "genai-int4") and p.must_hold} == {1.1}


def test_export_flags_are_checked_against_the_help(bench):
    old = "usage: paged-export [--dtype {fp16,bf16}] [--weights {fp16,int4}]\n  --dtype {fp16,bf16}\n"
    new = "usage: paged-export [--dtype {fp16,bf16,fp32}] [--weights {fp16,int4}]\n"
    assert "no fp32" in bench.export_flag_problem(["--dtype", "fp32"], old)
    assert bench.export_flag_problem(["--dtype", "fp32", "--weights", "int4"], new) is None
    assert bench.export_flag_problem([], old) is None
    assert "no --rotate option" in bench.export_flag_problem(["--rotate"], new)


def test_prompts_are_distinct_windows(bench):
    class Tok:
        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"input_ids": list(range(100))}

    assert bench.make_prompts(Tok(), "", 3, 5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    with pytest.raises(ValueError, match="100 tokens"):
        bench.make_prompts(Tok(), "", 8, 61)


def test_the_default_text_holds_the_batch_prompts():
    # 8 prompts of 61 tokens need 488 tokens; SmolLM2's tokenizer gives about 1 token per 4.5 characters
    assert len((REPO / "tests" / "data" / "ppl_text.txt").read_text(encoding="utf-8")) > 488 * 5


def test_list_runs_without_models(bench, capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in bench.ROWS)


def test_rounds_merge_and_pair_by_round(bench):
    """--rounds: a row's figures are medians over every run of its ok rounds (peak: the largest), a pair's ratio
    the median of its per-round ratios, which a drifting host does not bias as a ratio of medians can."""
    def raw(ttft, dec, peak, status="ok"):
        r = {"name": "x", "status": status, "ttft_ms": ttft, "decode_tok_s": dec, "peak_rss_mb": peak,
             "reps": [{"ttft_ms": ttft, "decode_tok_s": dec}], "load_s": 1.0, "tokens": [1, 2]}
        return r if status == "ok" else {"name": "x", "status": status, "reason": "boom"}

    fast, slow = bench.merge_rounds([raw(100, 50, 800), raw(300, 20, 900), raw(110, 60, 700)]), None
    assert fast["decode_tok_s"] == 50 and fast["ttft_ms"] == 110 and fast["peak_rss_mb"] == 900
    assert [r["decode_tok_s"] for r in fast["rounds"]] == [50, 20, 60]
    slow = bench.merge_rounds([raw(200, 40, 500), raw(600, 10, 500), raw(2, 30, 500, status="failed")])
    assert slow["decode_tok_s"] == 25 and len(slow["rounds"]) == 3 and slow["rounds"][2]["status"] == "failed"
    per = bench.round_ratios(fast, slow)
    assert per["decode"] == [50 / 40, 20 / 10] and per["ttft"] == [100 / 200, 300 / 600]
    (pair,) = bench.pair_results({"a": fast, "b": slow}, [bench.Pair("a", "b", min_decode=0.8)])
    assert pair["decode_ratio"] == pytest.approx((1.25 + 2.0) / 2) and pair["pass"] is True
    assert pair["ratio_of_medians"]["decode"] == pytest.approx(50 / 25)
    one = raw(100, 50, 800)
    assert bench.merge_rounds([one]) is one  # one round: the child's result as it is


def test_gguf_bytes_host_time_and_the_rss_check(bench, tmp_path):
    """llama.cpp's floor reads the GGUF file's size with a float16 cache; a pagedkit row's host time per decode step
    is its decode time less its onnxruntime runs' (the first run is the prefill's); the peak-RSS check fails past
    its bound."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    got = bench.gguf_model_bytes(gguf)
    assert got["weights"]["total"] == 1000 and got["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    res = bench._with_host({"decode_s": 1.0}, [0.5, 0.2, 0.2, 0.2, 0.2], 5)
    assert res["host_ms_per_step"] == pytest.approx(50.0) and res["host_fraction"] == pytest.approx(0.2)
    assert bench._with_host({"decode_s": 1.0}, None, 5) == {"decode_s": 1.0}  # not one onnxruntime segment
    assert bench._with_host({"decode_s": 1.0}, [0.5, 0.2], 5) == {"decode_s": 1.0}  # runs and steps disagree
    a = _raw("pagedkit-fp32", peak_rss_mb=900.0)
    b = _raw("genai-fp32", peak_rss_mb=800.0)
    (pair,) = bench.pair_results({"a": a, "b": b}, [bench.Pair("a", "b", max_rss=1.1)])
    assert pair["rss_ratio"] == pytest.approx(1.125) and pair["checks"] == {"peak RSS <= 1.1x": False}
    assert pair["pass"] is False
