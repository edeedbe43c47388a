"""paged-export, SmolLM3: NoPE layers (no_rope_layers[i] == 0: the node runs with do_rotary=0 and no cos / sin),
sliding-window layers from layer_types (use_sliding_window: the NoPE layers, reading block_table_windowed),
biases (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth: RoPE applied on the NoPE
layers; the built-in real configuration at 4 layers: layer 3 is NoPE)."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case

# NoPE on layers 1 and 3 (pattern [1, 0, 1, 0]), biases on
CASE = FamilyCase("SmolLM3Config", seed=9, overrides=dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                          attention_bias=True, mlp_bias=True))
# plus sliding windows (8 positions) on the NoPE layers; the prefill in chunks of 16 (the ring table)
SLIDING = FamilyCase("SmolLM3Config", seed=10, chunk=16, overrides=dict(
    num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("case", [CASE, SLIDING], ids=["nope", "nope-sliding"])
def test_smollm3_parity(tmp_path, dtype, case):
    print("smollm3", check_export(case, tmp_path, dtype))


@pytest.mark.parametrize("case", [CASE, SLIDING], ids=["nope", "nope-sliding"])
def test_smollm3_decomposed(tmp_path, case):
    print("smollm3 decomposed", check_decomposed(case, tmp_path))


def test_smollm3_nodes(tmp_path):
    """RoPE layers rotate in the node; NoPE layers have no rotary; the sliding (NoPE) layers are windowed and read
    the windowed table."""
    attrs = attention_attrs(export_case(SLIDING, tmp_path / "s", "fp16") / "model.onnx")
    assert [a.get("do_rotary", 0) for a in attrs] == [1, 0, 1, 0]
    assert ["cos_cache" in a["inputs"] for a in attrs] == [True, False, True, False]
    assert [a.get("local_window_size", -1) for a in attrs] == [-1, 8, -1, 8]
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table", "block_table_windowed"] * 2


def test_smollm3_refuses_inconsistent_sliding():
    from transformers import SmolLM3Config

    from pagedkit.exporters.families.smollm3 import SmolLM3Family

    config = SmolLM3Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                           use_sliding_window=False, sliding_window=8)
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        SmolLM3Family().check(config)


def test_smollm3_nope_rule_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.smollm3 import SmolLM3Family

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(SmolLM3Family, "uses_rope", lambda self, c, i: True))


@pytest.mark.slow
def test_smollm3_builtin(tmp_path):
    print("smollm3-3b builtin", check_builtin("smollm3-3b", tmp_path, num_layers=4))
