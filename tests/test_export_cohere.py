"""paged-export, Cohere (Command R, Aya 23): the parallel attention + MLP block with one bias-free input
LayerNorm, interleaved RoPE on every layer, logit_scale, tied embeddings (their teeth: tests/test_export_cohere2.py,
the same code), and use_qk_norm: a per-head LayerNorm with [H, D] gains on Q / K, in the graph before the node.
tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth."""

from __future__ import annotations

import pytest
import torch

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


class _Rotary(torch.nn.Module):
    """A rotary module returning cos / sin [1, P, R] of positions * inv_freq in the layout config['layout'] makes."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, x, pos):
        f = pos[..., None].double() * torch.tensor(self.config["inv"], dtype=torch.float64)  # [1, P, R / 2]
        f = f.repeat_interleave(2, -1) if self.config["layout"] == "interleaved" else torch.cat([f, f], -1)
        return f.cos().float(), f.sin().float()


def test_interleaved_tables_halves_and_refuses_rotate_half():
    """interleaved_tables: [f0, f0, f1, f1, ...] -> cos / sin of positions x inv_freq [P, R / 2]; a module in
    rotate_half form ([f, f]) is refused by name, not read as pairs."""
    from pagedkit.exporters.families.cohere import interleaved_tables

    inv = [1.0, 0.1, 0.01]
    cos, sin = interleaved_tables(_Rotary({"inv": inv, "layout": "interleaved"}), 7)
    ang = torch.arange(7, dtype=torch.float64)[:, None] * torch.tensor(inv, dtype=torch.float64)
    assert cos.shape == (7, 3) and sin.shape == (7, 3)
    torch.testing.assert_close(cos, ang.cos().float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ang.sin().float(), rtol=0, atol=1e-6)
    with pytest.raises(NotImplementedError, match="not pairwise repeated"):
        interleaved_tables(_Rotary({"inv": inv, "layout": "rotate_half"}), 7)
