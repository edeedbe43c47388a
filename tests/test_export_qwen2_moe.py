"""paged-export, Qwen2-MoE (Qwen1.5-MoE): Q / K / V biases, sliding layers from layer_types (ring table), the
softmax top-k MoE without renormalization (norm_topk_prob false, as Qwen1.5-MoE-A2.7B), the shared expert
scaled by sigmoid(shared_expert_gate), and a dense layer from mlp_only_layers (tests/family_harness.py: fp32 /
fp16 parity, decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import copy

import onnx
import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case
from export_utils import attention_attrs

# 3 layers: layer 1 dense (mlp_only_layers), 0 and 2 MoE; layer 0 sliding (window 8 < 37-token prompt: a ring
# table, prefill chunks of 16)
CASE = FamilyCase("Qwen2MoeConfig", seed=5, chunk=16, overrides=dict(
    num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
    use_sliding_window=True, sliding_window=8, max_window_layers=2))


def _ops(path):
    return [(n.op_type, n.name) for n in onnx.load(str(path)).graph.node]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_qwen2_moe_parity(tmp_path, dtype):
    print("qwen2_moe", check_export(CASE, tmp_path, dtype))
    ops = _ops(tmp_path / dtype / "model.onnx")
    assert [n for op, n in ops if op == "MoE"] == ["/model/layers.0/mlp/MoE", "/model/layers.2/mlp/MoE"]
    assert sum(op == "Sigmoid" and "shared_expert_gate" in n for op, n in ops) == 2
    attrs = attention_attrs(tmp_path / dtype / "model.onnx")
    assert [a.get("local_window_size", -1) for a in attrs] == [8, -1, -1]
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table_windowed", "block_table", "block_table"]


def test_qwen2_moe_decomposed(tmp_path):
    print("qwen2_moe decomposed", check_decomposed(CASE, tmp_path))


def test_qwen2_moe_renormalization_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.qwen2_moe import Qwen2MoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Qwen2MoeFamily, "normalize_routing",
                                                                 lambda self, config: not config.norm_topk_prob))


def test_qwen2_moe_shared_gate_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.qwen2_moe import Qwen2MoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(Qwen2MoeFamily, "shared_expert",
                                                                 lambda self, block: (block.shared_expert, None)))


def test_qwen2_moe_bias_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.base import DecoderFamily
    from pagedkit.exporters.families.qwen2_moe import Qwen2MoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(
        Qwen2MoeFamily, "qkv_weights", lambda self, attn: (DecoderFamily.qkv_weights(self, attn)[0], None)))


def test_qwen2_moe_dense_rule_has_teeth(tmp_path, monkeypatch):
    """mlp_only_layers ignored: layer 1 would be exported as MoE, but its module is the dense MLP (no router, no
    experts): the export refuses (a graph cannot be built from weights that do not exist)."""
    from pagedkit.exporters.families.mixtral import SoftmaxMoE
    from pagedkit.exporters.families.qwen2_moe import Qwen2MoeFamily

    def ignoring(self, config, i):
        config = copy.copy(config)
        config.mlp_only_layers = []
        return SoftmaxMoE.moe_layer(self, config, i)

    with monkeypatch.context() as m:
        m.setattr(Qwen2MoeFamily, "moe_layer", ignoring)
        with pytest.raises(NotImplementedError, match="layer 1: the dense-layer rule .* says MoE, the model's "
                                                      "module is Qwen2MoeMLP"):
            export_case(CASE, tmp_path / "broken")


@pytest.mark.slow
def test_qwen2_moe_builtin(tmp_path):
    print("qwen1.5-moe-a2.7b (4 layers, 8 experts, top-4)",
          check_builtin("qwen1.5-moe-a2.7b", tmp_path, num_experts=8))
