"""Gemma 3 (text): Gemma 2's sandwich norms, (1 + w) gains, scaled embeddings and query_pre_attn_scalar,
plus QK-norm fused into the node with (1 + w) gains (q_norm_weight / k_norm_weight), no softcaps, and
two rotary tables: the sliding layers use the local base frequency (`cos_cache_local` / `sin_cache_local`),
the full layers the global one with its scaling (`cos_cache` / `sin_cache`), both computed by the model's
own rotary module per layer type. Sliding layers read `block_table_windowed` when full layers exist."""

from __future__ import annotations

from ..graph import rotary_tables
from .gemma2 import Gemma2Family

LOCAL = "cos_cache_local"


class Gemma3Family(Gemma2Family):
    name = "gemma3"
    model_types = ("gemma3_text",)
    features = Gemma2Family.features[:-1] + (
        "QK-norm fused with (1 + w) gains", "separate cos/sin caches for sliding (local base) and full layers")

    def embed_scale(self, ctx) -> float:
        return float(self.decoder(ctx.model).embed_tokens.scalar_embed_scale)

    def qk_norm(self, attn):
        return self.module_qk_norm(attn)

    def rope_key(self, config, i: int) -> str:
        return LOCAL if config.layer_types[i] == "sliding_attention" else "cos_cache"

    def rope_tables(self, model, max_positions):
        rot = self.decoder(model).rotary_emb
        tables = {}
        for layer_type, key in (("sliding_attention", LOCAL), ("full_attention", "cos_cache")):
            if layer_type in model.config.layer_types:
                tables[key] = rotary_tables(rot, max_positions, layer_type=layer_type)
        return tables
