"""Cohere (Command R, Aya 23): a parallel attention + MLP block with bias-free LayerNorms, interleaved RoPE and a
logit scale; optional per-head QK LayerNorm (`use_qk_norm`).

Hugging Face (modeling_cohere.py):
- one input norm per layer and parallel sublayers: h = h + attn(ln(h)) + mlp(ln(h)) (graph: both sublayers read
  the one norm output; the residual adds them in HF's order, the pending MLP output fused into the next norm);
- CohereLayerNorm: mean-centred LayerNorm in float32 with a gain and no bias (graph: LayerNormalization /
  SkipLayerNormalization without bias, `Norm` kind "layer");
- interleaved RoPE on every layer (pairs (2i, 2i + 1): cos = repeat_interleave(freqs, 2)): the node's
  rotary_interleaved=1 with the table cos[:, ::2];
- use_qk_norm: q / k [T, H, D] LayerNorm over D with a gain per head and channel ([H, D]), before RoPE. The node's
  QK-norm is an RMSNorm with one [D] gain, so the graph computes Q, K, V separately, normalizes Q / K
  (Reshape [T, H, D], LayerNormalization over D, Mul by the [H, D] gain) and the node rotates them;
- logits * `logit_scale` (graph: Mul after the LM head), tied embeddings.
"""

from __future__ import annotations

import torch
from onnx import TensorProto

from ..graph import Norm, Residual, layer_norm, rotary_tables
from .base import DecoderFamily, ExportContext

I64 = TensorProto.INT64


def interleaved_tables(rotary_emb, max_positions: int):
    """cos / sin [P, R / 2] of a rotary module that returns interleaved tables [P, R] ([f0, f0, f1, f1, ...])."""
    cos, sin = rotary_tables(rotary_emb, max_positions, duplicated=False)
    if not torch.equal(cos[:, ::2], cos[:, 1::2]):
        raise NotImplementedError("rotary embedding whose cos table is not pairwise repeated (interleaved form)")
    return cos[:, ::2].contiguous(), sin[:, ::2].contiguous()


def head_layer_norm(ctx: ExportContext, x: str, norm, heads: int, head_dim: int, prefix: str, init: str) -> str:
    """x [T, heads * D]: LayerNorm of each head over D (no bias), times the gain [heads, D]; [T, heads * D]."""
    g = ctx.g
    t, shape = g.vi[x]
    x3 = g.node("Reshape", [x, g.const([-1, heads, head_dim], I64)], f"{prefix}/Reshape", out_type=t,
                out_shape=(shape[0], heads, head_dim))
    y = layer_norm(g, x3, torch.ones(head_dim), None, float(norm.variance_epsilon), prefix, f"{init}.unit")
    y = g.node("Mul", [y, g.initializer(init, norm.weight.detach().float(), t)], f"{prefix}/Mul", out_type=t,
               out_shape=g.shape_of(x3))
    return g.node("Reshape", [y, g.const([-1, heads * head_dim], I64)], f"{prefix}/Reshape_1", out_type=t,
                  out_shape=shape)


class CohereParallelFamily(DecoderFamily):
    """Cohere's parallel block, bias-free LayerNorm, interleaved RoPE, logit_scale (no model_types: the base of
    Cohere and Cohere 2)."""

    def norm(self, norm) -> Norm:
        return Norm(self.norm_weight(norm), self.norm_eps(norm), "layer", None)

    def rotary_interleaved(self, config) -> int:
        return 1

    def rope_tables(self, model, max_positions):
        return {"cos_cache": interleaved_tables(self.decoder(model).rotary_emb, max_positions)}

    def logits_multiplier(self, config) -> float:
        return float(config.logit_scale)

    def decoder_layer(self, ctx: ExportContext, i: int, layer, res: Residual) -> None:
        p = f"/model/layers.{i}"
        x = res.norm(self.norm(layer.input_layernorm), None, f"{p}/input_layernorm",
                     f"model.layers.{i}.input_layernorm.weight")
        a = self.attention(ctx, i, layer.self_attn, x)
        m = self.mlp(ctx, i, layer.mlp, x)
        res.add(a, f"{p}/attn")  # h + attn, then + mlp (pending: fused into the next norm's Skip)
        res.add(m, f"{p}/mlp")


class CohereFamily(CohereParallelFamily):
    name = "cohere"
    model_types = ("cohere",)
    features = DecoderFamily.features + (
        "parallel attention + MLP block (one input LayerNorm)", "LayerNorm without bias", "interleaved RoPE",
        "use_qk_norm (per-head LayerNorm with [H, D] gains, in the graph before the node)", "logit_scale")

    def project_qkv(self, ctx, i, attn, x):
        if not attn.use_qk_norm:
            return super().project_qkv(ctx, i, attn, x)
        l = ctx.spec.layers[i]
        p, ip = f"/model/layers.{i}/attn", f"model.layers.{i}.attn"
        q, k, v = self.separate_qkv(ctx, i, attn, x)
        q = head_layer_norm(ctx, q, attn.q_norm, l.num_heads, l.head_size, f"{p}/q_norm", f"{ip}.q_norm.weight")
        k = head_layer_norm(ctx, k, attn.k_norm, l.kv_num_heads, l.head_size, f"{p}/k_norm", f"{ip}.k_norm.weight")
        return q, k, v
