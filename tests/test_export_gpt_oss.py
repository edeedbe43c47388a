"""paged-export, GPT-OSS: head_sink, alternating sliding / full layers (block_table_windowed), biased
projections, YaRN (attention factor folded into cos/sin), MoE as com.microsoft::MoE. The parity check's
teeth: the head_sink input removed, the window one position shorter or longer, or a 5% wrong scale must
fail it."""

from __future__ import annotations

import onnx

import pytest

from export_utils import (assert_valid_export, attention_attrs, check_parity, export_tiny, mutated_export,
                          tiny_model)

YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=8, truncate=False)


@pytest.fixture(scope="module")
def gpt_oss():
    return tiny_model("GptOssConfig", seed=7, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                      rope_parameters=YARN)


@pytest.fixture(scope="module")
def gpt_oss_dir(gpt_oss, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_oss")
    export_tiny(gpt_oss, out)
    return out


def test_gpt_oss_parity_fp16(gpt_oss, gpt_oss_dir):
    hf, tmp_path = gpt_oss, gpt_oss_dir
    assert hf.model.rotary_emb.attention_scaling > 1.3  # YaRN's factor: folded into cos/sin by the export
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


@pytest.mark.parametrize("change", [dict(drop=("head_sink",)), dict(window=7), dict(window=9), dict(scale_factor=1.05)],
                         ids=["sink-removed", "window-7", "window-9", "scale+5%"])
def test_gpt_oss_parity_has_teeth(gpt_oss, gpt_oss_dir, tmp_path, change):
    change = dict(change)
    if "scale_factor" in change:
        change["scale"] = change.pop("scale_factor") * attention_attrs(gpt_oss_dir / "model.onnx")[0]["scale"]
    bad = mutated_export(gpt_oss_dir, tmp_path / "bad", **change)
    with pytest.raises(AssertionError, match="max\\|diff\\|") as exc:
        check_parity(gpt_oss, bad, prompt_lens=(11, 37), chunk=16, steps=4)
    print(f"gpt-oss teeth {change}: {exc.value}")
