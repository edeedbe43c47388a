"""paged-export, Llama: tiny random checkpoint -> fp16 PagedAttention graph; parity with HF eager over a
shuffled, non-contiguous block table (prefill + 16 teacher-forced decode steps); the parity check's
teeth (a wrong rotary layout, a 20% or a 5% wrong scale must fail it); bf16 against the bf16 checkpoint
within export_utils.BF16_TOL, whose teeth are a 5% wrong scale; the optional pagedkit inputs; the CLI path."""

from __future__ import annotations

import json
import math

import onnx
import pytest

from export_utils import (BF16_TOL, assert_valid_export, attention_attrs, bf16_weights, check_parity, export_tiny,
                          io_signature, save_tiny_checkpoint, tiny_model)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("LlamaConfig", seed=1)


@pytest.fixture(scope="module")
def llama_dir(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    export_tiny(llama, out)
    return out


def test_llama_parity_fp16(llama, llama_dir):
    assert_valid_export(llama_dir)
    rep = check_parity(llama, llama_dir)
    print(f"llama fp16: worst max|diff|/max|ref| = {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")
    attrs = attention_attrs(llama_dir / "model.onnx")
    assert len(attrs) == 2
    for a in attrs:
        assert a["num_heads"] == 4 and a["kv_num_heads"] == 2 and a["do_rotary"] == 1
        assert a["scale"] == pytest.approx(16 ** -0.5)
        assert "key" not in a["inputs"] and "value" not in a["inputs"]  # packed QKV, as onnxruntime-genai
        assert a["inputs"]["block_table"] == "block_table"
        assert a["inputs"]["attention_metadata"] == "attention_metadata"


def test_llama_graph_interface(llama_dir):
    sig = io_signature(llama_dir / "model.onnx")
    I, O = "input", "output"
    f16, i32, i64 = onnx.TensorProto.FLOAT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64
    expected = {"input_ids": (I, i64, 1), "block_table": (I, i32, 2), "cumulative_sequence_lengths": (I, i32, 1),
                "past_sequence_lengths": (I, i32, 1), "attention_metadata": (I, i32, 1), "logits": (O, f16, 2)}
    for i in range(2):
        for side in ("key", "value"):
            expected[f"past_key_values.{i}.{side}"] = (I, f16, 4)
            expected[f"present.{i}.{side}"] = (O, f16, 4)
    assert sig == expected
    cfg = json.loads((llama_dir / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["outputs"]["present_value_names"] == "present.%d.value"
    assert dec["state_groups"] == [{"kind": "paged_kv", "layer_ids": [0, 1]}]
    assert "sliding_window" not in dec


def _mutated(src, dst, **attrs):
    """A copy of the exported model with the given attributes overwritten on every PagedAttention node."""
    m = onnx.load(str(src / "model.onnx"))
    for n in m.graph.node:
        if n.op_type == "PagedAttention":
            for k, v in attrs.items():
                for a in list(n.attribute):
                    if a.name == k:
                        n.attribute.remove(a)
                n.attribute.append(onnx.helper.make_attribute(k, v))
    dst.mkdir()
    onnx.save(m, str(dst / "model.onnx"))
    (dst / "genai_config.json").write_text((src / "genai_config.json").read_text())
    return dst


@pytest.mark.parametrize("attrs", [dict(rotary_interleaved=1), dict(scale=0.3), dict(scale=1.05 * 16 ** -0.5)],
                         ids=["interleaved-rope", "scale+20%", "scale+5%"])
def test_parity_has_teeth(llama, llama_dir, tmp_path, attrs):
    bad = _mutated(llama_dir, tmp_path / "bad", **attrs)
    with pytest.raises(AssertionError, match="max\\|diff\\|") as exc:
        check_parity(llama, bad, steps=2)
    print(f"fp16 teeth {attrs}: {exc.value}")


@pytest.fixture(scope="module")
def llama_bf16_dir(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_bf16")
    res = export_tiny(llama, out, dtype="bf16")
    assert res.spec.dtype == "bfloat16"
    return out


def test_llama_bf16(llama, llama_bf16_dir):
    assert_valid_export(llama_bf16_dir)
    sig = io_signature(llama_bf16_dir / "model.onnx")
    assert sig["past_key_values.0.key"][1] == onnx.TensorProto.BFLOAT16
    assert sig["logits"][1] == onnx.TensorProto.FLOAT  # as onnxruntime-genai: float32 logits for bf16
    # against HF float32 weights: bf16 keeps 8 mantissa bits (fp16: 11), 8x fp16's tolerance; too loose to
    # catch a 5% wrong scale (test_llama_bf16_parity_has_teeth), so the bound that matters is the next one
    check_parity(llama, llama_bf16_dir, steps=4, tol=8 * 2e-2)
    # against the bf16 checkpoint (weights rounded to bf16, run in float32), greedy agreement included
    rep = check_parity(bf16_weights(llama), llama_bf16_dir, tol=BF16_TOL, near_tie=BF16_TOL)
    print(f"llama bf16 vs its bf16 checkpoint: worst {rep.worst_ratio:.4g} (bound {BF16_TOL}), "
          f"near-ties {rep.near_ties}")


@pytest.mark.parametrize("factor", [1.05, 0.95], ids=["scale+5%", "scale-5%"])
def test_llama_bf16_parity_has_teeth(llama, llama_bf16_dir, tmp_path, factor):
    """A 5% wrong attention scale on the bf16 export fails the bf16 parity bound."""
    bad = _mutated(llama_bf16_dir, tmp_path / "bad", scale=factor * 16 ** -0.5)
    # the whole run's worst step (check_parity with tol=BF16_TOL fails at the first step above it)
    rep = check_parity(bf16_weights(llama), bad, tol=math.inf, greedy=False)
    print(f"llama bf16 teeth, scale x{factor}: worst {rep.worst_ratio:.4g} vs bound {BF16_TOL}")
    assert rep.worst_ratio > BF16_TOL


def test_llama_extension_inputs(llama, tmp_path):
    """slot_mapping and query_positions as graph inputs (contract-decisions §8), fed by the harness."""
    export_tiny(llama, tmp_path, slot_mapping=True, query_positions=True)
    assert_valid_export(tmp_path)
    sig = io_signature(tmp_path / "model.onnx")
    assert sig["slot_mapping"] == ("input", onnx.TensorProto.INT32, 1)
    assert sig["query_positions"] == ("input", onnx.TensorProto.INT32, 1)
    for a in attention_attrs(tmp_path / "model.onnx"):
        assert a["inputs"]["slot_mapping"] == "slot_mapping"
        assert a["inputs"]["query_positions"] == "query_positions"
    check_parity(llama, tmp_path, steps=3)


def test_llama_from_checkpoint_dir(llama, tmp_path):
    """The paged-export path: a local safetensors folder (tokenizer files copied)."""
    from pagedkit.exporters.export import export

    ckpt = save_tiny_checkpoint(llama, tmp_path / "hf")
    res = export(str(ckpt), tmp_path / "out")
    assert res.weights == "safetensors"
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert_valid_export(tmp_path / "out")
    check_parity(llama, tmp_path / "out", steps=3)
