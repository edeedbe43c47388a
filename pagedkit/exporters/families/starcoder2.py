"""StarCoder2: Llama-shaped attention with biases on Q / K / V / O (`use_bias`), torch LayerNorms with bias
(`DecoderFamily.norm` maps nn.LayerNorm to a "layer" `Norm`: LayerNormalization, or SkipLayerNormalization
fused with the residual add), a non-gated MLP down(act(up(x))) over c_fc / c_proj with their biases
(`hidden_act` gelu_pytorch_tanh: Gelu approximate="tanh"), and a sliding window on every layer
(`config.sliding_window`, W positions including the current one, as Hugging Face's
create_sliding_window_causal_mask): all layers windowed, so every layer reads the plain `block_table`, as
Mistral. Tied embeddings (the default) reuse the embedding table as the LM head. Dropouts are inactive in
eval and not exported."""

from __future__ import annotations

from ..graph import plain_mlp
from .base import DecoderFamily


class Starcoder2Family(DecoderFamily):
    name = "starcoder2"
    model_types = ("starcoder2",)
    features = DecoderFamily.features + ("q / k / v / o biases", "LayerNorm with bias",
                                         "non-gated gelu MLP (c_fc / c_proj, biases)",
                                         "sliding window on every layer (local_window_size)")

    def layer_window(self, config, i, attn) -> int:
        w = getattr(config, "sliding_window", None)
        return int(w) if w else -1

    def mlp(self, ctx, i, mlp, x):
        return plain_mlp(ctx.g, x, (mlp.c_fc.weight, mlp.c_fc.bias), (mlp.c_proj.weight, mlp.c_proj.bias),
                         ctx.config.hidden_act, i)
