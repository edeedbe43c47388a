"""Mistral: Llama plus a sliding window on every layer (`config.sliding_window`, W positions including the
current one, as Hugging Face's mask). All layers are windowed, so, as onnxruntime-genai does for
all-windowed models, every layer reads the plain `block_table` (no `block_table_windowed`); the window is
the node's `local_window_size`. (onnxruntime-genai 0.18 itself drops Mistral's window: its nodes carry
local_window_size=-1; pagedkit keeps it, which is what the model computes.)"""

from __future__ import annotations

from .base import DecoderFamily


class MistralFamily(DecoderFamily):
    name = "mistral"
    model_types = ("mistral",)
    features = DecoderFamily.features + ("sliding window on every layer (local_window_size)",)

    def layer_window(self, config, i, attn) -> int:
        w = getattr(config, "sliding_window", None)
        return int(w) if w else -1
