"""paged-export, GPT-OSS: head_sink, alternating sliding / full layers (block_table_windowed), biased
projections, YaRN (attention factor folded into cos/sin), MoE as com.microsoft::MoE."""

from __future__ import annotations

import onnx

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, tiny_model

YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=8, truncate=False)


def test_gpt_oss_parity_fp16(tmp_path):
    hf = tiny_model("GptOssConfig", seed=7, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters=YARN)
    assert hf.model.rotary_emb.attention_scaling > 1.3  # YaRN's factor: folded into cos/sin by the export
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    attrs = attention_attrs(tmp_path / "model.onnx")
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table_windowed", "block_table"]
    assert [a["inputs"]["head_sink"] for a in attrs] == ["model.layers.0.attn.sinks", "model.layers.1.attn.sinks"]
    m = onnx.load(str(tmp_path / "model.onnx"))
    moe = [n for n in m.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2 and all(n.domain == "com.microsoft" for n in moe)
    assert any(n.op_type == "Add" and "qkv_proj" in n.name for n in m.graph.node)  # biased projections
    rep = check_parity(hf, tmp_path, prompt_lens=(11, 37), chunk=16)
    print(f"gpt-oss: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}")
