"""paged-export, Qwen2 / Qwen2.5: Q / K / V biases (tests/family_harness.py: fp32 / fp16 parity, decomposed in
onnxruntime, teeth)."""

from __future__ import annotations

import pytest

from family_harness import FamilyCase, check_decomposed, check_export, check_teeth

CASE = FamilyCase("Qwen2Config", seed=3)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_qwen2_parity(tmp_path, dtype):
    print("qwen2", check_export(CASE, tmp_path, dtype))


def test_qwen2_decomposed(tmp_path):
    print("qwen2 decomposed", check_decomposed(CASE, tmp_path))


def test_qwen2_bias_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.qwen2 import Qwen2Family

    def patch(m):
        m.setattr(Qwen2Family, "qkv_weights", lambda self, attn: (Qwen2Family.__mro__[1].qkv_weights(self, attn)[0], None))
    check_teeth(CASE, tmp_path, monkeypatch, patch)
