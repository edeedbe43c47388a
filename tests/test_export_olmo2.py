"""paged-export, OLMo 2: post-norms (no pre-norm) and QK-norm over the whole projection, computed in the graph
before the node (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-in)."""

from __future__ import annotations

import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth

CASE = FamilyCase("Olmo2Config", seed=0, overrides=dict(attention_bias=True))


def drop_norms(m, *names):
    """Monkeypatch: the graph norms named by `names` (a prefix part) return their input."""
    from pagedkit.exporters.graph import Norm

    apply = Norm.apply
    m.setattr(Norm, "apply", lambda self, g, x, prefix, init: x if any(n in prefix for n in names)
              else apply(self, g, x, prefix, init))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_olmo2_parity(tmp_path, dtype):
    print("olmo2", check_export(CASE, tmp_path, dtype))


def test_olmo2_decomposed(tmp_path):
    print("olmo2 decomposed", check_decomposed(CASE, tmp_path))


@pytest.mark.parametrize("norm", ["post_attention_layernorm", "post_feedforward_layernorm"])
def test_olmo2_post_norm_has_teeth(tmp_path, monkeypatch, norm):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: drop_norms(m, norm))


def test_olmo2_whole_qk_norm_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: drop_norms(m, "/attn/q_norm", "/attn/k_norm"))


@pytest.mark.slow
def test_olmo2_builtin(tmp_path):
    print("olmo-2-1b", check_builtin("olmo-2-1b", tmp_path, num_layers=4))
