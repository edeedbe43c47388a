"""paged-export, Qwen3-MoE: QK-norm fused into the node, sliding_window on every layer, the softmax top-k MoE
renormalized (norm_topk_prob true, as Qwen3-30B-A3B), dense layers from decoder_sparse_step
(tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import copy

import onnx
import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case
from export_utils import attention_attrs

# 4 layers, decoder_sparse_step 2: layers 1 and 3 MoE, 0 and 2 dense; window 8 on every layer
CASE = FamilyCase("Qwen3MoeConfig", seed=7, overrides=dict(
    num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    decoder_sparse_step=2, use_sliding_window=True, sliding_window=8, rms_norm_eps=1e-5))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_qwen3_moe_parity(tmp_path, dtype):
    print("qwen3_moe", check_export(CASE, tmp_path, dtype))
    nodes = onnx.load(str(tmp_path / dtype / "model.onnx")).graph.node
    assert [n.name for n in nodes if n.op_type == "MoE"] == ["/model/layers.1/mlp/MoE", "/model/layers.3/mlp/MoE"]
    attrs = attention_attrs(tmp_path / dtype / "model.onnx")
    assert [a["local_window_size"] for a in attrs] == [8] * 4
    assert all(a["inputs"]["q_norm_weight"] == f"model.layers.{i}.attn.q_norm.weight" for i, a in enumerate(attrs))


def test_qwen3_moe_decomposed(tmp_path):
    print("qwen3_moe decomposed", check_decomposed(CASE, tmp_path))


def test_qwen3_moe_renormalization_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.qwen3_moe import Qwen3MoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Qwen3MoeFamily, "normalize_routing",
                                                                 lambda self, config: not config.norm_topk_prob))


def test_qwen3_moe_qk_norm_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.qwen3_moe import Qwen3MoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Qwen3MoeFamily, "qk_norm", lambda self, attn: None))


def test_qwen3_moe_dense_rule_has_teeth(tmp_path, monkeypatch):
    """decoder_sparse_step ignored: layer 0 would be exported as MoE, but its module is the dense MLP: the export
    refuses."""
    from pagedkit.exporters.families.mixtral import SoftmaxMoE
    from pagedkit.exporters.families.qwen3_moe import Qwen3MoeFamily

    def ignoring(self, config, i):
        config = copy.copy(config)
        config.decoder_sparse_step = 1
        return SoftmaxMoE.moe_layer(self, config, i)

    with monkeypatch.context() as m:
        m.setattr(Qwen3MoeFamily, "moe_layer", ignoring)
        with pytest.raises(NotImplementedError, match="layer 0: the dense-layer rule .* says MoE, the model's "
                                                      "module is Qwen3MoeMLP"):
            export_case(CASE, tmp_path / "broken")


@pytest.mark.slow
def test_qwen3_moe_builtin(tmp_path):
    print("qwen3-30b-a3b (4 layers, 8 experts)", check_builtin("qwen3-30b-a3b", tmp_path, num_experts=8))
