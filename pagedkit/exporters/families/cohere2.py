"""Cohere 2 (Command R7B, Command A): Cohere's parallel block (one input LayerNorm without bias, h = h +
attn(ln(h)) + mlp(ln(h))), interleaved RoPE and logit_scale (`cohere.CohereParallelFamily`), with sliding /
global layers from `layer_types` and no QK-norm.

Hugging Face (modeling_cohere2.py): a sliding layer's window is its module's `sliding_window` (None on global
layers); sliding layers rotate, global layers have no RoPE (`if self.sliding_window is not None:
apply_rotary_pos_emb`): their nodes get no cos / sin (rope None, do_rotary 0). With global layers present the
sliding layers read `block_table_windowed`."""

from __future__ import annotations

from .base import DecoderFamily
from .cohere import CohereParallelFamily


class Cohere2Family(CohereParallelFamily):
    name = "cohere2"
    model_types = ("cohere2",)
    features = DecoderFamily.features + (
        "parallel attention + MLP block (one input LayerNorm)", "LayerNorm without bias", "interleaved RoPE",
        "sliding layers with RoPE, global layers without RoPE", "logit_scale")

    def check(self, config) -> None:
        other = set(config.layer_types) - {"sliding_attention", "full_attention"}
        if other:
            raise NotImplementedError(f"layer_types {sorted(other)}: only sliding_attention / full_attention")

    def rope_key(self, config, i: int) -> str | None:
        sliding = config.layer_types[i] == "sliding_attention" and config.sliding_window is not None
        return "cos_cache" if sliding else None
