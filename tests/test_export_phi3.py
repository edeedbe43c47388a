"""paged-export, Phi-3: fused qkv_proj and gate_up_proj, sliding window on every layer; LongRoPE refused."""

from __future__ import annotations

import pytest

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, tiny_model


def test_phi3_parity_fp16(tmp_path):
    hf = tiny_model("Phi3Config", seed=5, sliding_window=8, original_max_position_embeddings=256)
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    assert [a["local_window_size"] for a in attention_attrs(tmp_path / "model.onnx")] == [8, 8]
    rep = check_parity(hf, tmp_path)
    print(f"phi3: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")


def test_phi3_longrope_refused(tmp_path):
    hf = tiny_model("Phi3Config", seed=5, original_max_position_embeddings=64,
                    rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                         long_factor=[2.0] * 8, original_max_position_embeddings=64))
    with pytest.raises(NotImplementedError, match="longrope"):
        export_tiny(hf, tmp_path)
