"""paged-export, Gemma (1): (1 + w) RMSNorm gains, embeddings x sqrt(hidden) (HF's normalizer rounded to the
model dtype), hidden_act gelu_pytorch_tanh gated MLP (GemmaConfig's legacy "gelu" rewrite; hidden_activation
ignored, as HF GemmaMLP), tied embeddings, float32 residual stream (tests/family_harness.py: fp32 / fp16
parity, decomposed in onnxruntime, teeth, the built-in real configuration)."""

from __future__ import annotations

import onnx
import pytest
import torch

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case

# hidden_act "gelu" is rewritten by GemmaConfig to gelu_pytorch_tanh; hidden_activation "gelu" (exact) is what a
# family reading Gemma 2's field would wrongly use
CASE = FamilyCase("GemmaConfig", seed=4, overrides=dict(num_hidden_layers=3, hidden_act="gelu",
                                                        hidden_activation="gelu", attention_bias=True))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_gemma_parity(tmp_path, dtype):
    print("gemma", check_export(CASE, tmp_path, dtype))


def test_gemma_decomposed(tmp_path):
    print("gemma decomposed", check_decomposed(CASE, tmp_path))


def test_gemma_graph(tmp_path):
    """The MLP's Gelu is the tanh approximation (hidden_act after GemmaConfig's rewrite), the embedding Mul holds
    sqrt(hidden), the LM head reuses the (unscaled) embedding table."""
    m = onnx.load(str(export_case(CASE, tmp_path / "g", "fp16") / "model.onnx"))
    gelus = [n for n in m.graph.node if n.op_type == "Gelu"]
    assert gelus and all(onnx.helper.get_attribute_value(a) == b"tanh" for n in gelus for a in n.attribute
                         if a.name == "approximate")
    mul = next(n for n in m.graph.node if n.name == "/model/embed_tokens/Mul")
    init = {t.name: t for t in m.graph.initializer}
    assert float(onnx.numpy_helper.to_array(init[mul.input[1]])) == 8.0  # sqrt(64)
    assert next(n for n in m.graph.node if n.name == "/lm_head/Gemm").input[1] == "model.embed_tokens.weight"


def test_gemma_embed_scale_rounded_like_hf():
    """HF multiplies by embed_scale cast to the weight dtype: sqrt(3072) = 55.4256 -> 55.5 in bfloat16."""
    from types import SimpleNamespace

    from pagedkit.exporters.families.gemma import GemmaFamily

    emb = SimpleNamespace(scalar_embed_scale=3072 ** 0.5, weight=torch.zeros(1, dtype=torch.bfloat16))
    fam = GemmaFamily()
    fam.decoder = lambda model: SimpleNamespace(embed_tokens=emb)
    ctx = SimpleNamespace(model=None)
    assert fam.embed_scale(ctx) == 55.5
    emb.weight = torch.zeros(1, dtype=torch.float32)
    assert fam.embed_scale(ctx) == pytest.approx(3072 ** 0.5, rel=1e-7)


def test_gemma_refuses_bidirectional():
    from transformers import GemmaConfig

    from pagedkit.exporters.families.gemma import GemmaFamily

    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        GemmaFamily().check(GemmaConfig(use_bidirectional_attention=True))


def test_gemma_norm_gain_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.gemma import GemmaFamily

    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(GemmaFamily, "norm_weight", lambda self, norm: norm.weight.detach().float()))


def test_gemma_embed_scale_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.gemma import GemmaFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(GemmaFamily, "embed_scale", lambda self, ctx: 1.0))


@pytest.mark.slow
def test_gemma_builtin(tmp_path):
    print("gemma-2b builtin", check_builtin("gemma-2b", tmp_path, num_layers=4))
