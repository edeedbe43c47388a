"""paged-export, EXAONE 4: post-norms (no pre-norm), per-head QK-norm fused into the node, sliding / global
layers (window 8: the sliding layers read block_table_windowed, a ring, so the prefill is chunked by 16 over
prompts that wrap it) with RoPE on the sliding layers only (the global layers are NoPE when a window is set);
tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-in (the 1.2B: every layer
global, every layer rotated)."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth
from test_export_olmo2 import drop_norms

CASE = FamilyCase("Exaone4Config", seed=3, chunk=16, overrides=dict(
    num_hidden_layers=3, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]))


def family():
    from pagedkit.exporters.families.exaone4 import Exaone4Family

    return Exaone4Family


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_exaone4_parity(tmp_path, dtype):
    print("exaone4", check_export(CASE, tmp_path, dtype))
    if dtype == "fp16":
        attrs = attention_attrs(tmp_path / dtype / "model.onnx")
        assert [a.get("local_window_size", -1) for a in attrs] == [8, 8, -1]
        assert [a.get("do_rotary", 0) for a in attrs] == [1, 1, 0]
        assert [a["inputs"].get("cos_cache") for a in attrs] == ["cos_cache", "cos_cache", None]
        assert all("q_norm_weight" in a["inputs"] for a in attrs)


def test_exaone4_decomposed(tmp_path):
    print("exaone4 decomposed", check_decomposed(CASE, tmp_path))


@pytest.mark.parametrize("norm", ["post_attention_layernorm", "post_feedforward_layernorm"])
def test_exaone4_post_norm_has_teeth(tmp_path, monkeypatch, norm):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: drop_norms(m, norm))


def test_exaone4_qk_norm_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(family(), "qk_norm", lambda self, attn: None))


def test_exaone4_nope_rule_has_teeth(tmp_path, monkeypatch):
    """The global layer rotated too."""
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(family(), "rope_key", lambda *a: "cos_cache"))


@pytest.mark.parametrize("window", [-1, 9], ids=["full", "window+1"])
def test_exaone4_sliding_window_has_teeth(tmp_path, monkeypatch, window):
    def layer_window(self, config, i, attn):
        return window if config.layer_types[i] == "sliding_attention" else -1
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(family(), "layer_window", layer_window))


@pytest.mark.slow
def test_exaone4_builtin(tmp_path):
    print("exaone-4.0-1.2b", check_builtin("exaone-4.0-1.2b", tmp_path, num_layers=4))
