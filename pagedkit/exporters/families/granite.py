"""Granite (dense, model_type "granite"): Llama with four muP multipliers, each where HF applies it:
- embedding_multiplier: inputs_embeds * m (a Mul after the embedding Gather: `embed_multiplier`);
- residual_multiplier: h = h + m * sublayer(h) for the attention and the MLP sublayer (a Mul on each
  sublayer output [T, H] before it joins the residual stream: `decoder_layer`);
- attention_multiplier: the attention scale itself (replaces head_dim^-0.5: the node's `scale`);
- logits_scaling: logits / s (a Mul by 1 / s after the LM head: `logits_multiplier`).
Optional q/k/v/o biases (attention_bias) and MLP biases (mlp_bias) come from the modules.
The layer's feed-forward block is the base's `ffn` hook: Granite-MoE (granitemoe.py) replaces it with its experts."""

from __future__ import annotations

from ..graph import scale
from .base import DecoderFamily, ExportContext


class GraniteFamily(DecoderFamily):
    name = "granite"
    model_types = ("granite",)
    features = DecoderFamily.features + (
        "embedding_multiplier", "residual_multiplier on each sublayer output", "attention_multiplier as the scale",
        "logits / logits_scaling", "attention / MLP biases")

    def embed_multiplier(self, config) -> float:
        return float(config.embedding_multiplier)

    def residual_multiplier(self, config) -> float:
        return float(config.residual_multiplier)

    def attention_scale(self, attn, config) -> float:
        return float(config.attention_multiplier)  # HF: attn.scaling = attention_multiplier

    def logits_multiplier(self, config) -> float:
        return 1.0 / float(config.logits_scaling)

    def decoder_layer(self, ctx: ExportContext, i: int, layer, res) -> None:
        g, p, ip = ctx.g, f"/model/layers.{i}", f"model.layers.{i}"
        m = self.residual_multiplier(ctx.config)
        x = res.norm(self.norm(layer.input_layernorm), None, f"{p}/input_layernorm", f"{ip}.input_layernorm.weight")
        a = self.attention(ctx, i, layer.self_attn, x)
        res.add(scale(g, a, m, f"{p}/attn/residual_multiplier/Mul"), f"{p}/attn")
        x = res.norm(self.norm(layer.post_attention_layernorm), None, f"{p}/post_attention_layernorm",
                     f"{ip}.post_attention_layernorm.weight")
        res.add(scale(g, self.ffn(ctx, i, layer, x), m, f"{p}/mlp/residual_multiplier/Mul"), f"{p}/mlp")
