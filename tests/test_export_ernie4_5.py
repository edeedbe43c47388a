"""paged-export, Ernie 4.5 (dense): interleaved RoPE pairs (rotary_interleaved=1), use_bias (q / k / v / o and MLP
biases), explicit head_dim, tied embeddings (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime,
teeth: the RoPE pairing flipped, the QKV bias dropped, the MLP biases dropped; the built-in real configuration)."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case

# 6 heads x head_dim 16 = 96 != hidden 64: head_dim must come from the config
CASE = FamilyCase("Ernie4_5Config", seed=11, overrides=dict(use_bias=True, num_attention_heads=6,
                                                            num_key_value_heads=2))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_ernie4_5_parity(tmp_path, dtype):
    print("ernie4_5", check_export(CASE, tmp_path, dtype))


def test_ernie4_5_decomposed(tmp_path):
    print("ernie4_5 decomposed", check_decomposed(CASE, tmp_path))


def test_ernie4_5_nodes(tmp_path):
    for a in attention_attrs(export_case(CASE, tmp_path / "n", "fp16") / "model.onnx"):
        assert (a["do_rotary"], a["rotary_interleaved"], a["num_heads"], a["kv_num_heads"]) == (1, 1, 6, 2)


def test_ernie4_5_rope_pairing_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.ernie4_5 import Ernie4_5Family

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Ernie4_5Family, "rotary_interleaved",
                                                                lambda self, config: 0))


def test_ernie4_5_qkv_bias_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.base import DecoderFamily
    from pagedkit.exporters.families.ernie4_5 import Ernie4_5Family

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(
        Ernie4_5Family, "qkv_weights", lambda self, attn: (DecoderFamily.qkv_weights(self, attn)[0], None)))


def test_ernie4_5_mlp_bias_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families import base

    gated = base.gated_mlp

    def no_bias(g, x, gate, up, down, act, layer, **kw):
        return gated(g, x, (gate[0], None), (up[0], None), (down[0], None), act, layer, **kw)
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(base, "gated_mlp", no_bias))


@pytest.mark.slow
def test_ernie4_5_builtin(tmp_path):
    print("ernie-4.5-0.3b-pt builtin", check_builtin("ernie-4.5-0.3b-pt", tmp_path, num_layers=4))
