"""paged-export, Gemma 3 (text): QK-norm with (1 + w) gains fused into the node, separate cos/sin caches
for the sliding (local base) and full (global base, linear scaling) layers, sandwich norms, scaled
embeddings; sliding layers read block_table_windowed."""

from __future__ import annotations

import onnx

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, tiny_model

ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)}


def test_gemma3_parity_fp16(tmp_path):
    hf = tiny_model("Gemma3TextConfig", seed=8, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_parameters=ROPE)
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    attrs = attention_attrs(tmp_path / "model.onnx")
    assert [a["inputs"]["cos_cache"] for a in attrs] == ["cos_cache_local", "cos_cache_local", "cos_cache"]
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table_windowed"] * 2 + ["block_table"]
    assert all("q_norm_weight" in a["inputs"] for a in attrs)
    m = onnx.load(str(tmp_path / "model.onnx"))
    q0 = next(i for i in m.graph.initializer if i.name == "model.layers.0.attn.q_norm.weight")
    w = hf.model.layers[0].self_attn.q_norm.weight.detach().numpy()
    assert abs(onnx.numpy_helper.to_array(q0).astype("float32") - (1 + w)).max() < 1e-2  # (1 + w) gains
    rep = check_parity(hf, tmp_path, prompt_lens=(11, 37), chunk=16)
    print(f"gemma3: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")
