"""paged-export, Cohere (Command R, Aya 23): the parallel attention + MLP block with one bias-free input
LayerNorm, interleaved RoPE on every layer, logit_scale, tied embeddings (their teeth: tests/test_export_cohere2.py,
the same code), and use_qk_norm: a per-head LayerNorm with [H, D] gains on Q / K, in the graph before the node.
tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth."""

from __future__ import annotations

import pytest

from family_harness import FamilyCase, check_decomposed, check_export, check_teeth

CASE = FamilyCase("CohereConfig", seed=5, overrides=dict(use_qk_norm=True, logit_scale=0.3))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_cohere_parity(tmp_path, dtype):
    print("cohere", check_export(CASE, tmp_path, dtype))


def test_cohere_decomposed(tmp_path):
    print("cohere decomposed", check_decomposed(CASE, tmp_path))


def test_cohere_qk_norm_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.families.cohere import CohereFamily, CohereParallelFamily

    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(CohereFamily, "project_qkv", CohereParallelFamily.project_qkv))
