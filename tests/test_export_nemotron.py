"""paged-export, Nemotron: LayerNorm1P (gain 1 + w, bias), non-gated relu2 MLP, partial rotary, attention / MLP
biases (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import pytest

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth

# head_dim 16, partial_rotary_factor 0.5: rotary_dim 8 of 16 channels rotate
CASE = FamilyCase("NemotronConfig", seed=3, overrides=dict(partial_rotary_factor=0.5, attention_bias=True,
                                                          mlp_bias=True, hidden_act="relu2"))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_nemotron_parity(tmp_path, dtype):
    print("nemotron", check_export(CASE, tmp_path, dtype))


def test_nemotron_decomposed(tmp_path):
    print("nemotron decomposed", check_decomposed(CASE, tmp_path))


def _no_plus_one(m):
    """LayerNorm1P's + 1 dropped: gains w instead of 1 + w."""
    from pagedkit.exporters.families.base import DecoderFamily
    from pagedkit.exporters.families.nemotron import NemotronFamily

    m.setattr(NemotronFamily, "norm_weight", DecoderFamily.norm_weight)


def _relu(m):
    """relu instead of relu2 (squared ReLU)."""
    from pagedkit.exporters.families import nemotron

    real = nemotron.plain_mlp
    m.setattr(nemotron, "plain_mlp", lambda g, x, up, down, act, layer: real(g, x, up, down, "relu", layer))


def _full_width(m):
    """Partial rotary broken: the same frequencies, tables padded with identity columns (cos 1, sin 0) to
    head_dim / 2, so the node pairs (c, c + 8) over all 16 channels instead of (c, c + 4) over the first 8."""
    import torch

    from pagedkit.exporters.families.nemotron import NemotronFamily

    real = NemotronFamily.rope_tables

    def tables(self, model, n):
        out = {}
        for k, (cos, sin) in real(self, model, n).items():
            extra = 8 - cos.shape[1]
            out[k] = (torch.cat([cos, torch.ones(cos.shape[0], extra)], 1),
                      torch.cat([sin, torch.zeros(sin.shape[0], extra)], 1))
        return out
    m.setattr(NemotronFamily, "rope_tables", tables)


@pytest.mark.parametrize("patch", [_no_plus_one, _relu, _full_width], ids=["layernorm1p_plus_one", "relu2",
                                                                          "partial_rotary_width"])
def test_nemotron_features_have_teeth(tmp_path, monkeypatch, patch):
    check_teeth(CASE, tmp_path, monkeypatch, patch)


@pytest.mark.slow
def test_nemotron_builtin(tmp_path):
    print("nemotron-mini-4b", check_builtin("nemotron-mini-4b", tmp_path, num_layers=4))
