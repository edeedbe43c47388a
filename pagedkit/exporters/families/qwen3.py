"""Qwen3 (dense): Llama plus per-head QK RMSNorm, fused into the node through q_norm_weight /
k_norm_weight (qk_norm_epsilon); optional sliding layers through `layer_types`."""

from __future__ import annotations

from .base import DecoderFamily


class Qwen3Family(DecoderFamily):
    name = "qwen3"
    model_types = ("qwen3",)
    features = DecoderFamily.features + ("QK-norm fused (q_norm_weight / k_norm_weight)",
                                         "sliding layers from layer_types")

    def qk_norm(self, attn):
        return self.module_qk_norm(attn)
