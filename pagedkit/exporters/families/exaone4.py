"""EXAONE 4: OLMo 2's post-norms (no pre-norm; post_attention / post_feedforward RMSNorm on the sublayer outputs),
per-head QK RMSNorm before RoPE (q_norm / k_norm gains [D]: fused into the node, q_norm_weight / k_norm_weight /
qk_norm_epsilon), and the sliding / global hybrid of `layer_types` (the 32B: 3 sliding : 1 global).

Hugging Face (modeling_exaone4.py): a sliding layer's window is `config.sliding_window` (its module keeps the
window on every layer: only `layer_types` says which layers slide), and with a window configured the global
layers skip RoPE (`if self.sliding_window is None or self.is_sliding: apply_rotary_pos_emb`): their nodes get no
cos / sin (rope None, do_rotary 0). Without a window (the 1.2B: every layer full) every layer rotates."""

from __future__ import annotations

from .base import DecoderFamily
from .olmo2 import PostNormFamily


class Exaone4Family(PostNormFamily):
    name = "exaone4"
    model_types = ("exaone4",)
    features = DecoderFamily.features + (
        "post-norms (post-attention / post-feedforward RMSNorm, no pre-norm)", "QK-norm fused (per head)",
        "sliding / global layers from layer_types", "global layers without RoPE when a window is set")

    def check(self, config) -> None:
        other = set(config.layer_types) - {"sliding_attention", "full_attention"}
        if other:
            raise NotImplementedError(f"layer_types {sorted(other)}: only sliding_attention / full_attention")

    def _sliding(self, config, i: int) -> bool:
        return config.layer_types[i] == "sliding_attention"

    def layer_window(self, config, i, attn) -> int:
        w = config.sliding_window
        return int(w) if w and self._sliding(config, i) else -1

    def rope_key(self, config, i: int) -> str | None:
        return "cos_cache" if config.sliding_window is None or self._sliding(config, i) else None

    def qk_norm(self, attn):
        return self.module_qk_norm(attn)
