"""Llama (1/2/3/3.1/3.2): the base decoder as is. RoPE scaling (linear, llama3, YaRN) comes from the
model's own rotary module; attention/MLP biases are exported when the config has them."""

from __future__ import annotations

from .base import DecoderFamily


class LlamaFamily(DecoderFamily):
    name = "llama"
    model_types = ("llama",)
    features = DecoderFamily.features + ("attention_bias / mlp_bias",)
