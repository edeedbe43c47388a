"""SmolLM3: Llama with NoPE layers and optional sliding-window layers.

- NoPE: HF's attention rotates Q / K only when `config.no_rope_layers[i]` is truthy (1 = RoPE, 0 = no
  positional encoding; the default pattern drops RoPE on every `no_rope_layer_interval`-th layer, the
  real 3B model on layers 3, 7, 11, ...). A NoPE layer's node has no cos / sin (`rope_key` None ->
  do_rotary=0).
- Sliding windows: HF's eager mask follows `layer_types` ("sliding_attention" -> the sliding-window mask of
  `sliding_window` positions, the current one included); the config builds sliding layers only with
  `use_sliding_window` (on the NoPE layers). Windowed layers get local_window_size = sliding_window and, mixed
  with full layers, read `block_table_windowed`. A config whose `layer_types` marks sliding layers without
  `use_sliding_window` / `sliding_window` (HF's mask and its attention modules then disagree) is refused.
Biases (attention_bias, mlp_bias) come from the modules; tied LM head as the config says."""

from __future__ import annotations

from .base import DecoderFamily


class SmolLM3Family(DecoderFamily):
    name = "smollm3"
    model_types = ("smollm3",)
    features = DecoderFamily.features + (
        "NoPE layers (no_rope_layers[i] == 0: do_rotary=0)", "sliding-window layers from layer_types",
        "attention / MLP biases")

    def check(self, config) -> None:
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
        if sliding and not (config.use_sliding_window and config.sliding_window):
            raise NotImplementedError(
                f"layer_types marks layers {sliding} sliding but use_sliding_window={config.use_sliding_window}, "
                f"sliding_window={config.sliding_window}: Hugging Face's mask and attention modules disagree")

    def uses_rope(self, config, i: int) -> bool:
        return bool(config.no_rope_layers[i])

    def rope_key(self, config, i: int) -> str | None:
        return "cos_cache" if self.uses_rope(config, i) else None

    def layer_window(self, config, i: int, attn) -> int:
        return int(config.sliding_window) if config.layer_types[i] == "sliding_attention" else -1
