"""paged-export, Mistral: sliding window on every layer (local_window_size = sliding_window on every node,
plain block_table as onnxruntime-genai for all-windowed models); prompts longer than the window."""

from __future__ import annotations

import json

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, io_signature, tiny_model


def test_mistral_parity_fp16(tmp_path):
    hf = tiny_model("MistralConfig", seed=2, sliding_window=8)
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    attrs = attention_attrs(tmp_path / "model.onnx")
    assert [a["local_window_size"] for a in attrs] == [8, 8]
    assert all(a["inputs"]["block_table"] == "block_table" for a in attrs)
    assert "block_table_windowed" not in io_signature(tmp_path / "model.onnx")
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert "sliding_window" not in cfg["model"]["decoder"]
    rep = check_parity(hf, tmp_path, prompt_lens=(5, 29))  # 29 > window: the window masks keys
    print(f"mistral: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")


def test_mistral_without_window(tmp_path):
    hf = tiny_model("MistralConfig", seed=3, sliding_window=None)
    export_tiny(hf, tmp_path)
    assert all("local_window_size" not in a for a in attention_attrs(tmp_path / "model.onnx"))
    check_parity(hf, tmp_path, steps=3)
