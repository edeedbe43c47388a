"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj (already [q | k | v]) and fused gate_up_proj ([gate | up],
split into the two MLP MatMuls), sliding window on every layer (`config.sliding_window`: the node's
local_window_size, plain block_table).

Partial rotary (Phi-4-mini, partial_rotary_factor 0.75): Hugging Face rotates the first rotary_dim =
head_dim * factor channels of each head with rotate_half pairs (c, c + rotary_dim / 2) over those and passes
the rest; the exported cos / sin tables come from the model's own rotary module, so they are
[positions, rotary_dim / 2] wide and the node rotates exactly channels [0, rotary_dim) with the same pairs.

LongRoPE (Phi-3.5-mini / Phi-4-mini 128k): both the short and the long table are exported and one is picked
per step by the batch's longest sequence (rope.select_tables), as Hugging Face picks per forward. Tied
embeddings (Phi-4-mini) reuse the embedding table as the LM head (base)."""

from __future__ import annotations

from ..graph import gated_mlp
from .base import DecoderFamily


class Phi3Family(DecoderFamily):
    name = "phi3"
    model_types = ("phi3",)
    features = DecoderFamily.features + ("fused qkv_proj", "fused gate_up_proj", "sliding window on every layer",
                                         "partial rotary (partial_rotary_factor)",
                                         "LongRoPE short / long tables switched per step")

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
