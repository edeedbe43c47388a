"""OLMo 3: OLMo 2 (post-norms, whole-projection QK-norm) plus sliding-window layers from `layer_types`
(3 sliding : 1 full in the real models): a sliding layer's window is its HF module's `sliding_window` (None on
full layers), and with full layers present the sliding layers read `block_table_windowed`.

RoPE per layer type: HF keeps `rope_parameters[layer_type]` (a checkpoint's legacy `rope_scaling`, YaRN in the
long-context models, goes to the full layers only; the sliding layers keep the plain table) and its rotary module
takes the layer type. The graph holds one cos / sin table per type present, from that module: `cos_cache_local`
for the sliding layers, `cos_cache` for the full ones."""

from __future__ import annotations

from ..graph import rotary_tables
from .olmo2 import Olmo2Family

LOCAL = "cos_cache_local"
KEYS = {"sliding_attention": LOCAL, "full_attention": "cos_cache"}


class Olmo3Family(Olmo2Family):
    name = "olmo3"
    model_types = ("olmo3",)
    features = Olmo2Family.features + ("sliding / full layers from layer_types",
                                       "RoPE per layer type (YaRN on the full layers only)")

    def check(self, config) -> None:
        other = set(config.layer_types) - set(KEYS)
        if other:
            raise NotImplementedError(f"layer_types {sorted(other)}: only sliding_attention / full_attention")
        for t, rope in (config.rope_parameters or {}).items():
            kind = (rope or {}).get("rope_type", "default")
            if kind in ("dynamic", "longrope"):  # tables that change with the sequence length, per layer type
                raise NotImplementedError(f"rope_parameters[{t!r}] rope_type {kind!r}: pagedkit exports one static "
                                          "table per layer type")

    def rope_key(self, config, i: int) -> str:
        return KEYS[config.layer_types[i]]

    def rope_tables(self, model, max_positions):
        rot, types = self.decoder(model).rotary_emb, set(model.config.layer_types)
        return {KEYS[t]: rotary_tables(rot, max_positions, layer_type=t) for t in types}
