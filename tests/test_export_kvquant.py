"""paged-export with quantized KV caches (Llama): calibrated PER_TENSOR / PER_CHANNEL scales, PER_TOKEN scale
caches, Walsh-Hadamard rotation, int4 weights. The oracle is Hugging Face eager whose attention sees K/V
as the export's cache holds them (dequantized), so the fp16 tolerance applies unchanged; separately the
cache codes must be HF's K / V quantized with the exported scales (+-1 code at rounding boundaries). The SNR report lands in the pagedkit section of genai_config.json."""

from __future__ import annotations

import json

import onnx
import pytest

from export_quant_utils import check_quantized_parity
from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, io_signature, tiny_model

CASES = {  # (fp8 per-channel: fp8 codes of a static scale)
    "int8-per-tensor": dict(k_dtype="int8", v_dtype="int8", k_quant="PER_TENSOR", v_quant="PER_TENSOR"),
    "fp8-per-channel": dict(k_dtype="float8e4m3fn", v_dtype="float8e4m3fn", k_quant="PER_CHANNEL",
                            v_quant="PER_CHANNEL"),
    "int8-per-token": dict(k_dtype="int8", v_dtype="int8", k_quant="PER_TOKEN", v_quant="PER_TOKEN"),
    "int4-per-token-rotated": dict(k_dtype="int4", v_dtype="int4", k_quant="PER_TOKEN", v_quant="PER_TOKEN",
                                   rotate=True),
    "int4-k-per-channel-v-per-token": dict(k_dtype="int4", v_dtype="int4", k_quant="PER_CHANNEL",
                                           v_quant="PER_TOKEN"),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("LlamaConfig", seed=11)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_cache_parity(llama, tmp_path, case):
    from pagedkit.exporters.config import read_pagedkit_section
    from pagedkit.exporters.families.base import KVOptions

    kv = KVOptions(**CASES[case])
    res = export_tiny(llama, tmp_path, kv=kv)
    assert_valid_export(tmp_path)
    sig = io_signature(tmp_path / "model.onnx")
    attrs = attention_attrs(tmp_path / "model.onnx")
    for a in attrs:
        assert a.get("k_quant_type", "NONE") == kv.k_quant and a.get("v_quant_type", "NONE") == kv.v_quant
        assert a.get("qk_rotation", 0) == int(kv.rotate)
        for s, q in (("k", kv.k_quant), ("v", kv.v_quant)):
            assert (f"{s}_scale" in a["inputs"]) == (q in ("PER_TENSOR", "PER_CHANNEL"))
            assert (f"{s}_scale_cache" in a["inputs"]) == (q == "PER_TOKEN")
    if kv.k_dtype == "int4":
        assert sig["past_key_values.0.key"][1] == onnx.TensorProto.UINT8
        assert attrs[0]["k_cache_dtype"] == "int4"
    if kv.k_quant == "PER_TOKEN":
        assert sig["past_key_values.1.key_scale"] == ("input", onnx.TensorProto.FLOAT16, 3)
        assert sig["present.1.value_scale"] == ("output", onnx.TensorProto.FLOAT16, 3)
        cfg = json.loads((tmp_path / "genai_config.json").read_text())
        assert cfg["model"]["decoder"]["inputs"]["past_key_scale_names"] == "past_key_values.%d.key_scale"
    section = read_pagedkit_section(tmp_path)
    snr = section["calibration"]["snr_db"]
    assert set(snr) == {"0", "1"} and all(r["k_snr_db"] > 10 for r in snr.values())
    assert section["layers"][0]["k_cache"]["dtype"] == kv.k_dtype
    stats = check_quantized_parity(llama, tmp_path)
    print(case, res.summary(), stats)


def test_quantized_parity_has_teeth(llama, tmp_path):
    """The plain (unquantized) oracle does not match an int4 cache: reading the cache is what makes it pass."""
    from pagedkit.exporters.families.base import KVOptions

    export_tiny(llama, tmp_path, kv=KVOptions(k_dtype="int4", v_dtype="int4", k_quant="PER_TOKEN",
                                              v_quant="PER_TOKEN"))
    with pytest.raises(AssertionError, match="max\\|diff\\|"):
        check_parity(llama, tmp_path, steps=2)


def test_int4_weights(llama, tmp_path):
    """--weights int4: MatMul -> MatMulNBits by onnxruntime's quantizer. The oracle is the same graph with
    MatMuls over the weights decoded here from the packed nibbles (fp16 tolerance), and the decoded weights
    are the original ones within half a quantization step (round to nearest, scale = block amax / 7)."""
    import numpy as np

    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions
    from export_quant_utils import dequantized_matmul_model
    from export_utils import assert_close_logits, hf_greedy_sequence, run_tokens

    export_hf_model(llama, tmp_path / "int4", ExportOptions(progress=False), weight_format="int4")
    assert_valid_export(tmp_path / "int4")
    m = onnx.load(str(tmp_path / "int4" / "model.onnx"))
    ops = [n.op_type for n in m.graph.node]
    assert "MatMulNBits" in ops and "MatMul" not in ops
    codes_max = dequantized_matmul_model(tmp_path / "int4", tmp_path / "deq")
    assert len(codes_max) == ops.count("MatMulNBits") and max(codes_max.values()) <= 8
    # decoded weights vs the original weights: onnxruntime's symmetric int4 maps the block's largest-magnitude
    # element to -8 (scale = amax / 8), so the opposite extreme may clamp at +7: |W - W_q| <= one step, amax / 8
    fp16 = tmp_path / "fp16"
    export_tiny(llama, fp16)
    deq = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "deq" / "model.onnx")).graph.initializer}
    orig = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(fp16 / "model.onnx")).graph.initializer}
    w, wq = orig["lm_head.MatMul.weight"].astype(np.float32), deq["lm_head.MatMul.weight_Q4.dequantized"].astype(np.float32)
    step = np.abs(w).reshape(-1, 32, w.shape[1]).max(axis=1, keepdims=True) / 8  # per 32-row block
    err = np.abs(w - wq).reshape(-1, 32, w.shape[1]) / step
    assert err.max() <= 1 + 2e-3 and np.mean(err <= 0.5 + 2e-3) > 0.95, (err.max(), np.mean(err <= 0.5 + 2e-3))
    toks, lens = [], (9, 21)
    for n in lens:
        ids, _ = hf_greedy_sequence(llama, list(range(3, 3 + n)), 3)
        toks.append(ids)
    got = run_tokens(tmp_path / "int4", toks, lens)
    ref = run_tokens(tmp_path / "deq", toks, lens)
    assert_close_logits(got, ref, what="int4 weights vs decoded-weight MatMuls")
