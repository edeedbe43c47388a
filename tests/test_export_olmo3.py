"""paged-export, OLMo 3: OLMo 2's post-norms and whole-projection QK-norm plus sliding / full layers
(`layer_types`, window 8: the sliding layers read block_table_windowed, a ring, so the prefill is chunked by 16
over prompts that wrap it) and RoPE per layer type (plain table on the sliding layers, YaRN on the full ones:
two cos / sin tables). tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-in."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth
from test_export_olmo2 import drop_norms

ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=4.0, original_max_position_embeddings=64,
                               beta_fast=32.0, beta_slow=1.0)}
CASE = FamilyCase("Olmo3Config", seed=1, chunk=16, overrides=dict(
    num_hidden_layers=3, sliding_window=8, rope_parameters=ROPE,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"]))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_olmo3_parity(tmp_path, dtype):
    print("olmo3", check_export(CASE, tmp_path, dtype))
    if dtype == "fp16":
        attrs = attention_attrs(tmp_path / dtype / "model.onnx")
        assert [a.get("local_window_size", -1) for a in attrs] == [8, -1, 8]
        assert [a["inputs"]["block_table"] for a in attrs] == ["block_table_windowed", "block_table",
                                                               "block_table_windowed"]
        assert [a["inputs"]["cos_cache"] for a in attrs] == ["cos_cache_local", "cos_cache", "cos_cache_local"]
        assert all("q_norm_weight" not in a["inputs"] and "key" in a["inputs"] for a in attrs)


def test_olmo3_decomposed(tmp_path):
    print("olmo3 decomposed", check_decomposed(CASE, tmp_path))


def test_olmo3_post_norm_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: drop_norms(m, "post_attention_layernorm"))


def test_olmo3_whole_qk_norm_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: drop_norms(m, "/attn/q_norm", "/attn/k_norm"))


@pytest.mark.parametrize("window", [-1, 9], ids=["full", "window+1"])
def test_olmo3_sliding_window_has_teeth(tmp_path, monkeypatch, window):
    from pagedkit.exporters.families.olmo3 import Olmo3Family

    def layer_window(self, config, i, attn):
        return window if config.layer_types[i] == "sliding_attention" else -1
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Olmo3Family, "layer_window", layer_window))


def test_olmo3_rope_per_layer_type_has_teeth(tmp_path, monkeypatch):
    """Every layer on the full layers' (YaRN) table."""
    from pagedkit.exporters.families.olmo3 import Olmo3Family

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Olmo3Family, "rope_key", lambda *a: "cos_cache"))


@pytest.mark.slow
def test_olmo3_builtin(tmp_path):
    print("olmo-3-7b-instruct", check_builtin("olmo-3-7b-instruct", tmp_path, num_layers=4))


def test_olmo3_refuses_dynamic_rope(tmp_path):
    """A table that changes with the sequence length on one layer type is refused, naming the field."""
    from export_utils import export_tiny, tiny_model

    rope = dict(ROPE, full_attention=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    hf = tiny_model("Olmo3Config", num_hidden_layers=2, sliding_window=8, rope_parameters=rope,
                    layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(NotImplementedError, match="rope_parameters\\['full_attention'\\] rope_type 'dynamic'"):
        export_tiny(hf, tmp_path)
