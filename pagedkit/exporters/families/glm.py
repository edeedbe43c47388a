"""GLM-4 dense (model_type glm: GLM-4-9B-chat-hf; glm4: GLM-4-0414): Llama with
- q / k / v biases (attention_bias; none on o_proj), packed into the QKV product's bias;
- partial, interleaved RoPE: the rotary module covers head_dim * partial_rotary_factor channels (0.5: 64 of 128)
  and Hugging Face's apply_rotary_pos_emb rotates pairs (2i, 2i + 1) of those first channels with frequency i
  (cos[..., :half].repeat_interleave(2), rotate_half over (x[2i], x[2i + 1])), the rest pass: the node gets
  cos / sin [P, rotary_dim / 2] (the table width sets the rotary width) and rotary_interleaved=1;
- fused gate_up_proj [2I, H] ([gate | up]: silu(gate) * up), split into the two MLP products;
- glm4 only, sandwich norms: post_self_attn_layernorm on the attention output and post_mlp_layernorm on the MLP
  output, each before its residual add (post_attention_layernorm stays the pre-MLP norm).
"""

from __future__ import annotations

from ..graph import Residual, gated_mlp
from .base import DecoderFamily, ExportContext


class GlmFamily(DecoderFamily):
    name = "glm"
    model_types = ("glm", "glm4")
    features = DecoderFamily.features + (
        "q / k / v projection biases", "partial interleaved RoPE (partial_rotary_factor)", "fused gate_up_proj",
        "GLM-4-0414 sandwich norms (post_self_attn_layernorm, post_mlp_layernorm)")

    def rotary_interleaved(self, config) -> int:
        return 1

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)  # [2I, H] rows [gate | up]
        b = mlp.gate_up_proj.bias
        bg, bu = b.chunk(2, dim=0) if b is not None else (None, None)
        return gated_mlp(ctx.g, x, (gate, bg), (up, bu), (mlp.down_proj.weight, mlp.down_proj.bias),
                         ctx.config.hidden_act, i)

    def decoder_layer(self, ctx: ExportContext, i: int, layer, res: Residual) -> None:
        if not hasattr(layer, "post_mlp_layernorm"):  # glm: the Llama layer
            return super().decoder_layer(ctx, i, layer, res)
        g, p, ip = ctx.g, f"/model/layers.{i}", f"model.layers.{i}"
        x = res.norm(self.norm(layer.input_layernorm), None, f"{p}/input_layernorm", f"{ip}.input_layernorm.weight")
        a = self.attention(ctx, i, layer.self_attn, x)
        a = self.norm(layer.post_self_attn_layernorm).apply(g, a, f"{p}/post_self_attn_layernorm",
                                                            f"{ip}.post_self_attn_layernorm.weight")
        res.add(a, f"{p}/attn")
        x = res.norm(self.norm(layer.post_attention_layernorm), None, f"{p}/post_attention_layernorm",
                     f"{ip}.post_attention_layernorm.weight")
        m = self.mlp(ctx, i, layer.mlp, x)
        m = self.norm(layer.post_mlp_layernorm).apply(g, m, f"{p}/post_mlp_layernorm",
                                                      f"{ip}.post_mlp_layernorm.weight")
        res.add(m, f"{p}/mlp")
