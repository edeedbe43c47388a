"""paged-export, Mixtral: Mistral's sliding window on every layer and the softmax top-k MoE (renormalized) as
one com.microsoft::MoE node per layer (tests/family_harness.py: fp32 / fp16 parity, decomposed in
onnxruntime, teeth: the renormalization flipped, the window dropped)."""

from __future__ import annotations

import onnx
import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth
from export_utils import attention_attrs

# 4 experts, top-2 (token-dependent choices); window 8 < the 37-token prompt
CASE = FamilyCase("MixtralConfig", seed=11, overrides=dict(num_local_experts=4, num_experts_per_tok=2,
                                                           sliding_window=8))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_mixtral_parity(tmp_path, dtype):
    print("mixtral", check_export(CASE, tmp_path, dtype))
    m = onnx.load(str(tmp_path / dtype / "model.onnx"))
    moe = [n for n in m.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2 and all(n.domain == "com.microsoft" for n in moe)
    for n in moe:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        assert (a["k"], a["normalize_routing_weights"], a["activation_type"], a["swiglu_fusion"]) == \
            (2, 1, b"swiglu", 1)
    assert [a["local_window_size"] for a in attention_attrs(tmp_path / dtype / "model.onnx")] == [8, 8]


def test_mixtral_decomposed(tmp_path):
    print("mixtral decomposed", check_decomposed(CASE, tmp_path))


def test_mixtral_renormalization_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.mixtral import MixtralFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(MixtralFamily, "normalize_routing",
                                                                 lambda self, config: False))


def test_mixtral_window_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.mixtral import MixtralFamily

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(MixtralFamily, "layer_window",
                                                                 lambda self, config, i, attn: -1))


@pytest.mark.slow
def test_mixtral_builtin(tmp_path):
    """4 layers at real dimensions, 3 of the 8 experts so that top-2 still chooses (each expert is 176M
    parameters: measured worst 0.0050, peak 16.2 GB)."""
    print("mixtral-8x7b (4 layers, 3 experts)", check_builtin("mixtral-8x7b", tmp_path, num_layers=4, num_experts=3))
