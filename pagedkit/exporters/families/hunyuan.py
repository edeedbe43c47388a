"""HunYuan dense (Hunyuan-0.5B / 1.8B / 4B / 7B, model_type hunyuan_v1_dense): Llama with a per-head RMSNorm on Q
and K (query_layernorm / key_layernorm, gains [D]) applied AFTER RoPE.

Hugging Face: q, k = apply_rotary_pos_emb(q, k, cos, sin); q = query_layernorm(q); k = key_layernorm(k); then
attention (the cache holds the normalized K). The node's fused QK-norm runs before its RoPE, so RoPE cannot
run in the node here: `rope_in_node` is False, Q / K / V are three products (`separate_qkv`), Q and K are
rotated in the graph (rope.apply_rope, half-split pairs (c, c + D / 2), at rope.token_positions), then
RMSNorm'd per head ([T, H * D] -> [T, H, D] -> RMSNormalization over D -> [T, H * D]), and the node runs with
do_rotary=0.

RoPE scaling: HunYuan's rotary module turns rope_type "dynamic" with an "alpha" into its own "ntk_alpha": a
fixed base rope_theta * alpha ** (D / (D - 2)), the same at every sequence length (no per-length update), so
the table from the model's own rotary module is exact at every position. (pagedkit's generic check still
refuses a --max-seq-len beyond max_position_embeddings for any "dynamic" config.) Tied embeddings (the small
models) reuse the embedding table as the LM head."""

from __future__ import annotations

from onnx import TensorProto

from ..graph import rms_norm
from ..rope import apply_rope, token_positions
from .base import DecoderFamily

I64 = TensorProto.INT64


class HunYuanDenseFamily(DecoderFamily):
    name = "hunyuan_v1_dense"
    model_types = ("hunyuan_v1_dense",)
    features = DecoderFamily.features + ("per-head QK RMSNorm after RoPE (RoPE in the graph, node do_rotary=0)",
                                         "dynamic-alpha NTK RoPE (fixed base theta * alpha ** (D / (D - 2)))",
                                         "attention_bias")

    def rope_in_node(self, config, i) -> bool:
        return False

    def project_qkv(self, ctx, i, attn, x):
        l = ctx.spec.layers[i]
        q, k, v = self.separate_qkv(ctx, i, attn, x)
        q = self.rope_norm(ctx, i, q, l.num_heads, attn.query_layernorm, "q")
        k = self.rope_norm(ctx, i, k, l.kv_num_heads, attn.key_layernorm, "k")
        return q, k, v

    def rope_norm(self, ctx, i, x, heads, norm, name):
        """x [T, heads * D]: RoPE, then the per-head RMSNorm (Hugging Face's order)."""
        return self.head_norm(ctx, i, self.rope(ctx, i, x, heads, name), heads, norm, name)

    def rope(self, ctx, i, x, heads, name):
        l = ctx.spec.layers[i]
        return apply_rope(ctx.g, x, heads, l.head_size, ctx.rope[l.rope], token_positions(ctx.g, ctx.io),
                          interleaved=False, prefix=f"/model/layers.{i}/attn/{name}_rope")

    def head_norm(self, ctx, i, x, heads, norm, name):
        """RMSNorm over each head's D channels of x [T, heads * D] (gain [D])."""
        g, d = ctx.g, ctx.spec.layers[i].head_size
        p = f"/model/layers.{i}/attn/{name}_norm"
        t, (rows, width) = g.vi[x]
        x3 = g.node("Reshape", [x, g.const([-1, heads, d], I64)], f"{p}/Reshape", out_type=t,
                    out_shape=(rows, heads, d))
        y = rms_norm(g, x3, self.norm_weight(norm), self.norm_eps(norm), p, f"model.layers.{i}.attn.{name}_norm.weight")
        return g.node("Reshape", [y, g.const([-1, width], I64)], f"{p}/Reshape_1", out_type=t, out_shape=(rows, width))
