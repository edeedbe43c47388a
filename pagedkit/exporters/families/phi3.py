"""Phi-3 (mini / medium, short context): fused qkv_proj (already [q | k | v]) and fused gate_up_proj
([gate | up], split into the two MLP MatMuls), sliding window on every layer (`config.sliding_window`),
partial rotary through the rotary module's table width. LongRoPE (128k variants) switches tables with
the sequence length at run time and is refused."""

from __future__ import annotations

from ..graph import gated_mlp
from .base import DecoderFamily


class Phi3Family(DecoderFamily):
    name = "phi3"
    model_types = ("phi3",)
    features = DecoderFamily.features + ("fused qkv_proj", "fused gate_up_proj",
                                         "sliding window on every layer")

    def layer_window(self, config, i, attn) -> int:
        w = getattr(config, "sliding_window", None)
        return int(w) if w else -1

    def qkv_weights(self, attn):
        return attn.qkv_proj.weight, attn.qkv_proj.bias

    def mlp(self, ctx, i, mlp, x):
        w = mlp.gate_up_proj.weight
        gate, up = w.chunk(2, dim=0)
        b = mlp.gate_up_proj.bias
        bg, bu = b.chunk(2, dim=0) if b is not None else (None, None)
        act = ctx.config.hidden_act
        return gated_mlp(ctx.g, x, (gate, bg), (up, bu), (mlp.down_proj.weight, mlp.down_proj.bias), act, i)
