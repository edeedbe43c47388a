"""paged-export, Qwen2 / Qwen2.5: Q / K / V biases (tests/family_harness.py: fp32 / fp16 parity, decomposed in
onnxruntime, teeth)."""

from __future__ import annotations

import pytest

from family_harness import FamilyCase, check_decomposed, check_export, check_teeth

CASE = FamilyCase("Qwen2Config", seed=3)
# use_sliding_window: layers from max_window_layers on slide (HF's layer_types); mixed with full layers, the
# windowed ones read block_table_windowed (a ring: prefill in chunks within its capacity)
WINDOWED = FamilyCase("Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=1), seed=4, chunk=16)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_qwen2_parity(tmp_path, dtype):
    print("qwen2", check_export(CASE, tmp_path, dtype))


def test_qwen2_sliding_layers(tmp_path):
    from export_utils import attention_attrs

    print("qwen2 windowed", check_export(WINDOWED, tmp_path, "fp16"))
    attrs = attention_attrs(tmp_path / "fp16" / "model.onnx")
    assert [a.get("local_window_size", -1) for a in attrs] == [-1, 8, 8]
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table", "block_table_windowed", "block_table_windowed"]


def test_qwen2_window_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.base import DecoderFamily
    from pagedkit.exporters.families.qwen2 import Qwen2Family

    def patch(m):  # the window one position longer than HF's
        m.setattr(Qwen2Family, "layer_window",
                  lambda self, config, i, attn: (lambda w: w + 1 if w > 0 else w)(
                      DecoderFamily.layer_window(self, config, i, attn)))
    check_teeth(WINDOWED, tmp_path, monkeypatch, patch)


def test_qwen2_decomposed(tmp_path):
    print("qwen2 decomposed", check_decomposed(CASE, tmp_path))


def test_qwen2_bias_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.qwen2 import Qwen2Family

    def patch(m):
        m.setattr(Qwen2Family, "qkv_weights", lambda self, attn: (Qwen2Family.__mro__[1].qkv_weights(self, attn)[0], None))
    check_teeth(CASE, tmp_path, monkeypatch, patch)


@pytest.mark.slow
def test_qwen2_builtin(tmp_path):
    """Qwen/Qwen2.5-0.5B-Instruct's configuration at 4 layers, random weights, vs HF eager."""
    from family_harness import check_builtin

    print("qwen2.5-0.5b-instruct", check_builtin("qwen2.5-0.5b-instruct", tmp_path))
