"""Nemotron (Nemotron-4 / Minitron / Nemotron-Mini): Llama-shaped attention with three differences.

- LayerNorm1P: Hugging Face's NemotronLayerNorm1P is a torch LayerNorm (mean-centred, with bias) whose
  forward uses weight + 1; the graph norm is a LayerNorm ("layer" `Norm`, SkipLayerNormalization when fused
  with the residual add) with gain 1 + w and the module's bias.
- Non-gated MLP: down(act(up(x))) with `hidden_act` relu2 (squared ReLU: Relu, then Mul by itself) —
  `graph.plain_mlp`; up / down biases when `mlp_bias`.
- Partial rotary (`partial_rotary_factor`, 0.5 on the released models): HF rotates the first
  head_dim * factor channels of each head (rotate_half pairs over those) and passes the rest; the cos / sin
  tables from the model's rotary module are [positions, rotary_dim / 2] wide, so the node rotates exactly those
  channels with the same pairs.
Q / K / V / O biases when `attention_bias`; scale head_dim ** -0.5 (the HF module's)."""

from __future__ import annotations

from ..graph import plain_mlp
from .base import DecoderFamily


class NemotronFamily(DecoderFamily):
    name = "nemotron"
    model_types = ("nemotron",)
    features = DecoderFamily.features + ("LayerNorm1P (LayerNorm with gain 1 + w and bias)",
                                         "non-gated relu2 MLP", "partial rotary (partial_rotary_factor)",
                                         "attention_bias / mlp_bias")

    def norm_weight(self, norm):
        """NemotronLayerNorm1P normalizes with weight + 1 (its bias as is, through `DecoderFamily.norm`)."""
        return 1.0 + norm.weight.detach().float()

    def mlp(self, ctx, i, mlp, x):
        return plain_mlp(ctx.g, x, (mlp.up_proj.weight, mlp.up_proj.bias),
                         (mlp.down_proj.weight, mlp.down_proj.bias), ctx.config.hidden_act, i)
