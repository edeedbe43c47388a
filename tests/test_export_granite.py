"""paged-export, Granite (dense): embedding_multiplier, residual_multiplier (h + m * sublayer), attention_multiplier
(the attention scale), logits / logits_scaling, attention and MLP biases (tests/family_harness.py: fp32 / fp16
parity, decomposed in onnxruntime, one teeth test per multiplier, the built-in real configuration)."""

from __future__ import annotations

import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth

# every multiplier away from 1 (and the scale away from head_dim^-0.5 = 0.25), biases on
CASE = FamilyCase("GraniteConfig", seed=5, overrides=dict(
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0,
    attention_bias=True, mlp_bias=True))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_granite_parity(tmp_path, dtype):
    print("granite", check_export(CASE, tmp_path, dtype))


def test_granite_decomposed(tmp_path):
    print("granite decomposed", check_decomposed(CASE, tmp_path))


@pytest.mark.parametrize("hook, value", [
    ("embed_multiplier", lambda self, config: 1.0),
    ("residual_multiplier", lambda self, config: 1.0),
    ("attention_scale", lambda self, attn, config: attn.head_dim ** -0.5),
    ("logits_multiplier", lambda self, config: 1.0),
], ids=["embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"])
def test_granite_multiplier_has_teeth(tmp_path, monkeypatch, hook, value):
    from pagedkit.exporters.families.granite import GraniteFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(GraniteFamily, hook, value))


@pytest.mark.slow
def test_granite_builtin(tmp_path):
    print("granite-3.1-2b-instruct builtin", check_builtin("granite-3.1-2b-instruct", tmp_path, num_layers=4))
