"""paged-export, StarCoder2: q / k / v / o and MLP (c_fc / c_proj) biases, LayerNorm with bias, non-gated
gelu_pytorch_tanh MLP, sliding window on every layer (plain block_table), tied embeddings
(tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs, io_signature
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case, model_of

# window 8 < prompts 11 / 37: the window masks keys at every step
CASE = FamilyCase("Starcoder2Config", seed=4, overrides=dict(sliding_window=8, use_bias=True,
                                                            hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_starcoder2_parity(tmp_path, dtype):
    hf, _ = model_of(CASE)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    print("starcoder2", check_export(CASE, tmp_path, dtype))


def test_starcoder2_decomposed(tmp_path):
    print("starcoder2 decomposed", check_decomposed(CASE, tmp_path))


def test_starcoder2_window_on_every_layer(tmp_path):
    out = export_case(CASE, tmp_path / "fp16")
    assert [a["local_window_size"] for a in attention_attrs(out / "model.onnx")] == [8, 8]
    assert "block_table_windowed" not in io_signature(out / "model.onnx")


def _no_mlp_bias(m):
    from pagedkit.exporters.families import starcoder2

    real = starcoder2.plain_mlp
    m.setattr(starcoder2, "plain_mlp", lambda g, x, up, down, act, layer: real(g, x, (up[0], None), (down[0], None),
                                                                               act, layer))


def _no_norm_bias(m):
    from pagedkit.exporters.families.base import DecoderFamily
    from pagedkit.exporters.families.starcoder2 import Starcoder2Family

    def norm(self, module):
        n = DecoderFamily.norm(self, module)
        n.bias = None
        return n
    m.setattr(Starcoder2Family, "norm", norm)


def _no_window(m):
    from pagedkit.exporters.families.starcoder2 import Starcoder2Family

    m.setattr(Starcoder2Family, "layer_window", lambda self, config, i, attn: -1)


@pytest.mark.parametrize("patch", [_no_mlp_bias, _no_norm_bias, _no_window], ids=["mlp_bias", "layernorm_bias",
                                                                                  "window"])
def test_starcoder2_features_have_teeth(tmp_path, monkeypatch, patch):
    check_teeth(CASE, tmp_path, monkeypatch, patch)


@pytest.mark.slow
def test_starcoder2_builtin(tmp_path):
    print("starcoder2-3b", check_builtin("starcoder2-3b", tmp_path, num_layers=4))
