"""paged-export, Cohere 2: the parallel attention + MLP block with one bias-free input LayerNorm, interleaved
RoPE, logit_scale, tied embeddings; the sliding layers (window 8: they read block_table_windowed, a ring, so the
prefill is chunked by 16 over prompts that wrap it) rotate and the global layers have no RoPE.
tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-in."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth

CASE = FamilyCase("Cohere2Config", seed=4, chunk=16, overrides=dict(
    num_hidden_layers=3, sliding_window=8, logit_scale=0.3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"]))


def parallel():
    from pagedkit.exporters.families.cohere import CohereParallelFamily

    return CohereParallelFamily


def sequential(self, ctx, i, layer, res):
    """The sequential block instead: h += attn(ln(h)); h += mlp(ln(h)) (the same gain, a second norm)."""
    p, w = f"/model/layers.{i}", f"model.layers.{i}.input_layernorm.weight"
    res.add(self.attention(ctx, i, layer.self_attn, res.norm(self.norm(layer.input_layernorm), None, f"{p}/ln1", w)),
            f"{p}/attn")
    res.add(self.mlp(ctx, i, layer.mlp, res.norm(self.norm(layer.input_layernorm), None, f"{p}/ln2", w + "2")),
            f"{p}/mlp")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_cohere2_parity(tmp_path, dtype):
    print("cohere2", check_export(CASE, tmp_path, dtype))
    if dtype == "fp16":
        attrs = attention_attrs(tmp_path / dtype / "model.onnx")
        assert [a.get("local_window_size", -1) for a in attrs] == [8, -1, 8]
        assert [a.get("do_rotary", 0) for a in attrs] == [1, 0, 1]
        assert [a.get("rotary_interleaved", 0) for a in attrs] == [1, 0, 1]


def test_cohere2_decomposed(tmp_path):
    print("cohere2 decomposed", check_decomposed(CASE, tmp_path))


def test_cohere2_parallel_block_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(parallel(), "decoder_layer", sequential))


def test_cohere2_layer_norm_has_teeth(tmp_path, monkeypatch):
    """RMSNorm (not mean-centred) instead."""
    from pagedkit.exporters.graph import Norm

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(
        parallel(), "norm", lambda self, n: Norm(self.norm_weight(n), self.norm_eps(n))))


def test_cohere2_interleaved_rope_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(parallel(), "rotary_interleaved", lambda *a: 0))


def test_cohere2_nope_rule_has_teeth(tmp_path, monkeypatch):
    """The global layer rotated too."""
    from pagedkit.exporters.families.cohere2 import Cohere2Family

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Cohere2Family, "rope_key", lambda *a: "cos_cache"))


@pytest.mark.parametrize("window", [-1, 9], ids=["full", "window+1"])
def test_cohere2_sliding_window_has_teeth(tmp_path, monkeypatch, window):
    from pagedkit.exporters.families.cohere2 import Cohere2Family

    def layer_window(self, config, i, attn):
        return window if config.layer_types[i] == "sliding_attention" else -1
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Cohere2Family, "layer_window", layer_window))


def test_cohere2_logit_scale_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(parallel(), "logits_multiplier", lambda *a: 1.0))


@pytest.mark.slow
def test_cohere2_builtin(tmp_path):
    """4 layers (3 sliding with RoPE, then the global NoPE layer), random weights, vs HF eager (measured: worst
    0.00197, peak 14.3 GB: the 256000 x 4096 tied embedding dominates)."""
    print("command-r7b", check_builtin("command-r7b", tmp_path, num_layers=4))
