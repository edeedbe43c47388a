"""OLMo 2: post-norms and QK-norm over the whole projection.

Hugging Face (modeling_olmo2.py), per layer, with no norm before the sublayers:
  h = h + post_attention_layernorm(attn(h));  h = h + post_feedforward_layernorm(mlp(h))
and in the attention q = q_norm(q_proj(x)) [T, Hq * D], k = k_norm(k_proj(x)) [T, Hkv * D]: one RMSNorm over
all heads together (gains [Hq * D] / [Hkv * D]), before RoPE. The node's q_norm_weight normalizes each head on
its own, so it cannot express this: the graph computes Q, K, V as three products (`separate_qkv`), applies the
two RMSNorms (RMSNormalization over the last axis) and feeds Q / K / V separately to the node, which rotates.

Shared by OLMo 3 / OLMoE / EXAONE 4: `PostNormFamily` (the layer above, no pre-norm) and `whole_qk_norm`.
"""

from __future__ import annotations

from ..graph import Residual
from .base import DecoderFamily, ExportContext


def whole_qk_norm(family: DecoderFamily, ctx: ExportContext, i: int, attn, x: str, clip: float | None = None
                  ) -> tuple[str, str, str]:
    """Q [T, Hq * D] = q_norm(q_proj x), K [T, Hkv * D] = k_norm(k_proj x) (RMSNorm over the whole projection),
    V [T, Hkv * D] = v_proj x; each clamped to [-clip, clip] after the norms when `clip` (OLMoE's clip_qkv)."""
    g = ctx.g
    p, ip = f"/model/layers.{i}/attn", f"model.layers.{i}.attn"
    q, k, v = family.separate_qkv(ctx, i, attn, x)
    q = family.norm(attn.q_norm).apply(g, q, f"{p}/q_norm", f"{ip}.q_norm.weight")
    k = family.norm(attn.k_norm).apply(g, k, f"{p}/k_norm", f"{ip}.k_norm.weight")
    if clip is None:
        return q, k, v
    lo, hi = g.const(-float(clip), g.float_type), g.const(float(clip), g.float_type)
    return tuple(g.node("Clip", [t, lo, hi], f"{p}/{n}_clip/Clip", out_type=g.vi[t][0], out_shape=g.shape_of(t))
                 for t, n in ((q, "q"), (k, "k"), (v, "v")))


class PostNormFamily(DecoderFamily):
    """Sublayers read the residual stream itself; their outputs are RMS-normed before the residual add
    (post_attention_layernorm / post_feedforward_layernorm). No model_types: a base for OLMo 2 / 3, EXAONE 4."""

    def decoder_layer(self, ctx: ExportContext, i: int, layer, res: Residual) -> None:
        g, p, ip = ctx.g, f"/model/layers.{i}", f"model.layers.{i}"
        a = self.attention(ctx, i, layer.self_attn, res.flush(f"{p}/input"))
        a = self.norm(layer.post_attention_layernorm).apply(g, a, f"{p}/post_attention_layernorm",
                                                            f"{ip}.post_attention_layernorm.weight")
        res.add(a, f"{p}/attn")
        m = self.mlp(ctx, i, layer.mlp, res.flush(f"{p}/attn"))
        m = self.norm(layer.post_feedforward_layernorm).apply(g, m, f"{p}/post_feedforward_layernorm",
                                                              f"{ip}.post_feedforward_layernorm.weight")
        res.add(m, f"{p}/mlp")


class Olmo2Family(PostNormFamily):
    name = "olmo2"
    model_types = ("olmo2",)
    features = DecoderFamily.features + ("post-norms (post-attention / post-feedforward RMSNorm, no pre-norm)",
                                         "QK-norm over the whole projection (in the graph, before the node)")

    def project_qkv(self, ctx, i, attn, x):
        return whole_qk_norm(self, ctx, i, attn, x)
