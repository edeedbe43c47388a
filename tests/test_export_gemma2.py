"""paged-export, Gemma 2: sandwich norms with (1 + w) gains, embedding scale, attention softcap (node),
final-logit softcap (graph), query_pre_attn_scalar scale, alternating sliding / full layers; the sliding
layers read block_table_windowed (a ring whose block ids repeat), as onnxruntime-genai; chunked prefill
(as the ring requires) over prompts long enough to wrap the ring."""

from __future__ import annotations

import json

import pytest

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, io_signature, tiny_model


def test_gemma2_parity_fp16(tmp_path):
    hf = tiny_model("Gemma2Config", seed=6, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                    attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    attrs = attention_attrs(tmp_path / "model.onnx")
    assert [a.get("local_window_size", -1) for a in attrs] == [8, -1, 8]
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table_windowed", "block_table",
                                                           "block_table_windowed"]
    for a in attrs:
        assert a["softcap"] == pytest.approx(20.0)
        assert a["scale"] == pytest.approx(24 ** -0.5)
    sig = io_signature(tmp_path / "model.onnx")
    assert sig["block_table_windowed"][2] == 2
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    sw = cfg["model"]["decoder"]["sliding_window"]
    assert sw["window_size"] == 8 and sw["layers"] == [0, 2]
    assert cfg["search"]["chunk_size"] == 16 and cfg["engine"]["dynamic_batching"]["prefix_caching"] is False
    rep = check_parity(hf, tmp_path, prompt_lens=(11, 37), chunk=16)  # 37 + 16 > 3 ring blocks: it wraps
    print(f"gemma2: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")
