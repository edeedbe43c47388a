"""paged-export, GLM-4 dense: glm (GLM-4-9B-chat-hf) and glm4 (GLM-4-0414, sandwich norms): q / k / v biases,
partial interleaved RoPE (partial_rotary_factor 0.5: 8 of head_dim 16 channels, pairs (2i, 2i + 1)), fused
gate_up_proj (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-ins)."""

from __future__ import annotations

import pytest
import torch

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth

GLM = FamilyCase("GlmConfig", seed=2, overrides=dict(attention_bias=True))
GLM4 = FamilyCase("Glm4Config", seed=3, overrides=dict(attention_bias=True))
CASES = {"glm": GLM, "glm4": GLM4}


def _family():
    from pagedkit.exporters.families.glm import GlmFamily

    return GlmFamily


@pytest.mark.parametrize("model", list(CASES))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_glm_parity(tmp_path, model, dtype):
    print(model, check_export(CASES[model], tmp_path, dtype))


@pytest.mark.parametrize("model", list(CASES))
def test_glm_decomposed(tmp_path, model):
    print(model, "decomposed", check_decomposed(CASES[model], tmp_path))


def test_glm_rotary_is_partial():
    from family_harness import model_of

    hf = model_of(GLM)[0]
    tables = _family()().rope_tables(hf, 64)["cos_cache"]
    assert tables[0].shape == (64, 4)  # 8 of 16 channels rotate


def _full_width(m):
    """partial_rotary_factor ignored: tables of a rotary module over the whole head_dim (frequencies
    base^(-2i / 16), all 16 channels rotated) instead of its first 8."""
    import copy

    from pagedkit.exporters.graph import rotary_tables

    def tables(self, model, n):
        config = copy.deepcopy(model.config)
        config.rope_parameters["partial_rotary_factor"] = 1.0
        return {"cos_cache": rotary_tables(type(model.model.rotary_emb)(config=config), n)}
    m.setattr(_family(), "rope_tables", tables)


def _no_qkv_bias(m):
    Fam = _family()
    qkv = Fam.qkv_weights
    m.setattr(Fam, "qkv_weights", lambda self, attn: (qkv(self, attn)[0], None))


def _no_post_norm(which):
    """glm4 without one sandwich norm: that layer's module reported absent (the layer built as without it)."""
    def patch(m):
        from pagedkit.exporters.graph import Norm

        real = Norm.apply
        m.setattr(Norm, "apply",
                  lambda self, g, x, prefix, init: x if which in prefix else real(self, g, x, prefix, init))
    return patch


TEETH = {
    "glm": {"partial_rotary_width": _full_width,
            "rotary_pairing": lambda m: m.setattr(_family(), "rotary_interleaved", lambda self, c: 0),
            "qkv_bias": _no_qkv_bias},
    "glm4": {"post_self_attn_layernorm": _no_post_norm("post_self_attn_layernorm"),
             "post_mlp_layernorm": _no_post_norm("post_mlp_layernorm"),
             "rotary_pairing": lambda m: m.setattr(_family(), "rotary_interleaved", lambda self, c: 0)},
}


@pytest.mark.parametrize("model, feature", [(m, f) for m, fs in TEETH.items() for f in fs])
def test_glm_feature_has_teeth(tmp_path, monkeypatch, model, feature):
    check_teeth(CASES[model], tmp_path, monkeypatch, TEETH[model][feature])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["glm-4-9b-chat-hf", "glm-4-9b-0414"])
def test_glm_builtin(tmp_path, name):
    """THUDM/glm-4-9b-chat-hf and THUDM/GLM-4-9B-0414 at 4 layers, random weights, vs HF eager (measured: worst
    0.0032 / 0.0024, peak 15.1 GB each: the 151552 x 4096 embedding and LM head are 5 GB in float32)."""
    print(name, check_builtin(name, tmp_path, num_layers=4))
