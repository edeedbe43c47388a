"""paged-export, Qwen3: QK-norm fused into the node (q_norm_weight / k_norm_weight, qk_norm_epsilon)."""

from __future__ import annotations

import pytest

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, tiny_model


def test_qwen3_parity_fp16(tmp_path):
    hf = tiny_model("Qwen3Config", seed=4, rms_norm_eps=1e-5)  # not the contract default: written
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    for i, a in enumerate(attention_attrs(tmp_path / "model.onnx")):
        assert a["inputs"]["q_norm_weight"] == f"model.layers.{i}.attn.q_norm.weight"
        assert a["inputs"]["k_norm_weight"] == f"model.layers.{i}.attn.k_norm.weight"
        assert a["qk_norm_epsilon"] == pytest.approx(hf.config.rms_norm_eps)
    rep = check_parity(hf, tmp_path)
    print(f"qwen3: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")
