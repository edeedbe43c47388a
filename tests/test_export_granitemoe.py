"""paged-export, Granite-MoE / Granite-MoE-Shared: Granite's multipliers with the routed experts in one
com.microsoft::MoE node (HF's softmax over the top-k logits == softmax, top-k, renormalized), and the dense
shared expert of granitemoeshared (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth:
routing weights left unnormalized, the residual multiplier dropped, the shared expert dropped; the built-in real
configuration with fewer experts)."""

from __future__ import annotations

import onnx
import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case

MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)
CASE = FamilyCase("GraniteMoeConfig", seed=7, overrides=dict(
    num_local_experts=4, num_experts_per_tok=2, attention_bias=True, **MULTIPLIERS))
SHARED = FamilyCase("GraniteMoeSharedConfig", seed=8, overrides=dict(
    num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, **MULTIPLIERS))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("case", [CASE, SHARED], ids=["granitemoe", "granitemoeshared"])
def test_granitemoe_parity(tmp_path, dtype, case):
    print(case.config, check_export(case, tmp_path, dtype))


@pytest.mark.parametrize("case", [CASE, SHARED], ids=["granitemoe", "granitemoeshared"])
def test_granitemoe_decomposed(tmp_path, case):
    print(case.config, "decomposed", check_decomposed(case, tmp_path))


def test_granitemoe_graph(tmp_path):
    """One MoE node per layer (k 2, renormalized, SwiGLU), no expert computed outside it."""
    m = onnx.load(str(export_case(CASE, tmp_path / "g", "fp16") / "model.onnx"))
    moes = [n for n in m.graph.node if n.op_type == "MoE"]
    assert len(moes) == 2
    for n in moes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert (attrs["k"], attrs["normalize_routing_weights"], attrs["activation_type"]) == (2, 1, b"swiglu")


def test_granitemoe_routing_normalization_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.granitemoe import GraniteMoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(GraniteMoeFamily, "normalize_routing",
                                                                lambda self, config: False))


def test_granitemoe_residual_multiplier_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.granitemoe import GraniteMoeFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(GraniteMoeFamily, "residual_multiplier",
                                                                lambda self, config: 1.0))


def test_granitemoeshared_shared_expert_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.granitemoe import GraniteMoeFamily

    def drop_shared(m):
        ffn = GraniteMoeFamily.ffn

        class NoShared:
            def __init__(self, layer):
                self.block_sparse_moe, self.shared_mlp = layer.block_sparse_moe, None
        m.setattr(GraniteMoeFamily, "ffn", lambda self, ctx, i, layer, x: ffn(self, ctx, i, NoShared(layer), x))
    check_teeth(SHARED, tmp_path, monkeypatch, drop_shared)


@pytest.mark.slow
def test_granitemoe_builtin(tmp_path):
    print("granite-3.1-1b-a400m-instruct builtin",
          check_builtin("granite-3.1-1b-a400m-instruct", tmp_path, num_layers=4, num_experts=16))


def test_granitemoe_features_list_the_granite_multipliers():
    """--list / docs/export.md: both model types name every Granite multiplier the export applies (embedding,
    residual, attention scale, logits / logits_scaling), its attention biases and the MoE, and not Granite's
    MLP biases (the experts have none)."""
    from pagedkit.exporters import registry

    feats = registry.supported()
    for mt in ("granitemoe", "granitemoeshared"):
        text = "; ".join(feats[mt])
        for word in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                     "attention biases", "com.microsoft::MoE", "shared expert"):
            assert word in text, (mt, word, text)
        assert "MLP biases" not in text, (mt, text)
