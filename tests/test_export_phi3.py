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


def _longrope(original: int, **kw):
    short, long = [1.0 + 0.1 * j for j in range(8)], [2.0 + 0.5 * j for j in range(8)]
    return tiny_model("Phi3Config", seed=5, original_max_position_embeddings=original, **kw,
                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=short,
                                           long_factor=long, original_max_position_embeddings=original))


@pytest.mark.parametrize("original, prompts", [(64, (11, 37)), (32, (37, 45))], ids=["short", "long"])
def test_phi3_longrope_parity(tmp_path, original, prompts):
    """LongRoPE: both tables exported and one picked per step by the batch's longest sequence (Hugging Face
    picks by the longest position of its forward). short: every sequence stays within original (short
    factors); long: every prompt is already past it (long factors from the first step)."""
    hf = _longrope(original)
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    rep = check_parity(hf, tmp_path, prompt_lens=prompts, steps=6)
    print(f"phi3 longrope {original}: worst {rep.worst_ratio:.4g}")


def test_phi3_longrope_tables_have_teeth(tmp_path):
    """The short and long tables swapped fail the parity check in both regimes."""
    import onnx

    from export_utils import check_parity as parity

    for original, prompts in ((64, (11, 37)), (32, (37, 45))):
        hf = _longrope(original)
        out = tmp_path / str(original)
        export_tiny(hf, out)
        m = onnx.load(str(out / "model.onnx"))
        for n in m.graph.node:
            if n.op_type == "Where" and "/model/rope/" in n.name:
                n.input[1], n.input[2] = n.input[2], n.input[1]
        onnx.save(m, str(out / "model.onnx"))
        with pytest.raises(AssertionError):
            parity(hf, out, prompt_lens=prompts, steps=6)
