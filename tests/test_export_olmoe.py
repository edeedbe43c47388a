"""paged-export, OLMoE: pre-norm decoder, QK-norm over the whole projection (in the graph before the node),
clip_qkv, softmax top-k routed SwiGLU experts in one com.microsoft::MoE node per layer with norm_topk_prob
(tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-in).

Routing is a discrete choice: the tiny model's router decisions on the test sequences are not near-ties (the
parity checks pass with greedy agreement; a flipped expert would move the logits by a jump)."""

from __future__ import annotations

import onnx
import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth
from test_export_olmo2 import drop_norms

CASE = FamilyCase("OlmoeConfig", seed=2, overrides=dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                                        clip_qkv=1.5))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_olmoe_parity(tmp_path, dtype):
    print("olmoe", check_export(CASE, tmp_path, dtype))
    if dtype == "fp16":
        nodes = onnx.load(str(tmp_path / dtype / "model.onnx")).graph.node
        moe = [n for n in nodes if n.op_type == "MoE"]
        assert len(moe) == 2 and all(n.domain == "com.microsoft" for n in moe)
        assert len([n for n in nodes if n.op_type == "Clip"]) == 6  # Q, K, V of each layer


def test_olmoe_decomposed(tmp_path):
    print("olmoe decomposed", check_decomposed(CASE, tmp_path))


def test_olmoe_whole_qk_norm_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch, lambda m: drop_norms(m, "/attn/q_norm", "/attn/k_norm"))


def test_olmoe_clip_qkv_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families import olmoe

    whole = olmoe.whole_qk_norm
    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(olmoe, "whole_qk_norm", lambda *a, clip=None: whole(*a, clip=None)))


def test_olmoe_routing_normalization_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families import olmoe

    moe = olmoe.softmax_moe
    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(olmoe, "softmax_moe", lambda *a, normalize, **kw: moe(*a, normalize=not normalize,
                                                                                         **kw)))


@pytest.mark.slow
def test_olmoe_builtin(tmp_path):
    print("olmoe-1b-7b", check_builtin("olmoe-1b-7b", tmp_path, num_layers=4, num_experts=8))
