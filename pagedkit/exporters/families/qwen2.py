"""Qwen2 / Qwen2.5 (dense): Llama with biases on the Q / K / V projections (none on O), packed into the QKV
product's bias. Sliding layers, when `use_sliding_window` is set, come from the attention modules
(`layer_types`, layers from `max_window_layers` on)."""

from __future__ import annotations

from .base import DecoderFamily


class Qwen2Family(DecoderFamily):
    name = "qwen2"
    model_types = ("qwen2",)
    features = DecoderFamily.features + ("q / k / v projection biases", "sliding layers from layer_types")
