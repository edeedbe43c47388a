"""Gemma 2: sandwich norms (post-attention and post-feedforward RMSNorm on the sublayer outputs), RMSNorm
gains stored as (1 + w), embeddings scaled by sqrt(hidden_size), attention softcap (node `softcap`),
final-logit softcap (Tanh in the graph), scale = query_pre_attn_scalar ** -0.5 (from the HF module),
alternating sliding / full layers (`layer_types`): the sliding layers read `block_table_windowed`, as
onnxruntime-genai. The residual stream stays float32 (Gemma activations overflow float16), as
onnxruntime-genai does for Gemma; matrix products run in the export dtype."""

from __future__ import annotations

from onnx import TensorProto

from ..graph import Residual, cast, rms_norm
from .base import DecoderFamily, ExportContext


class Gemma2Family(DecoderFamily):
    name = "gemma2"
    model_types = ("gemma2",)
    features = DecoderFamily.features + (
        "sandwich norms, (1 + w) RMSNorm gains", "embedding scale sqrt(hidden)", "attention softcap",
        "final-logit softcap", "query_pre_attn_scalar scale", "alternating sliding / full layers",
        "float32 residual stream")

    def norm_weight(self, norm):
        return 1.0 + norm.weight.detach().float()

    def attention_softcap(self, config) -> float:
        return float(getattr(config, "attn_logit_softcapping", None) or 0.0)

    def embed_scale(self, ctx: ExportContext) -> float:
        return ctx.config.hidden_size ** 0.5

    def embed(self, ctx: ExportContext) -> str:
        g = ctx.g
        h = super().embed(ctx)
        normalizer = g.const(self.embed_scale(ctx), g.float_type)
        h = g.node("Mul", [h, normalizer], "/model/embed_tokens/Mul", out_type=g.float_type,
                   out_shape=g.shape_of(h))
        return cast(g, h, TensorProto.FLOAT, "/model/embed_tokens/Cast")

    def _post_norm(self, ctx, x, norm, prefix, init_name):
        return rms_norm(ctx.g, cast(ctx.g, x, TensorProto.FLOAT, f"{prefix}/Cast"), self.norm_weight(norm),
                        self.norm_eps(norm), prefix, init_name)

    def decoder_layer(self, ctx: ExportContext, i: int, layer, res: Residual) -> None:
        p, ip = f"/model/layers.{i}", f"model.layers.{i}"
        x = res.norm(self.norm_weight(layer.input_layernorm), self.norm_eps(layer.input_layernorm),
                     f"{p}/input_layernorm", f"{ip}.input_layernorm.weight")
        a = self.attention(ctx, i, layer.self_attn, x)
        a = self._post_norm(ctx, a, layer.post_attention_layernorm, f"{p}/post_attention_layernorm",
                            f"{ip}.post_attention_layernorm.weight")
        res.add(a, f"{p}/attn")
        x = res.norm(self.norm_weight(layer.pre_feedforward_layernorm),
                     self.norm_eps(layer.pre_feedforward_layernorm),
                     f"{p}/pre_feedforward_layernorm", f"{ip}.pre_feedforward_layernorm.weight")
        m = self.mlp(ctx, i, layer.mlp, x)
        m = self._post_norm(ctx, m, layer.post_feedforward_layernorm, f"{p}/post_feedforward_layernorm",
                            f"{ip}.post_feedforward_layernorm.weight")
        res.add(m, f"{p}/mlp")

    def final_softcap(self, ctx: ExportContext, y: str) -> str:
        cap = getattr(ctx.config, "final_logit_softcapping", None)
        if not cap:
            return y
        g = ctx.g
        c = g.const(float(cap), g.float_type)
        t, shape = g.vi[y]
        d = g.node("Div", [y, c], "/lm_head/softcap/Div", out_type=t, out_shape=shape)
        d = g.node("Tanh", [d], "/lm_head/softcap/Tanh", out_type=t, out_shape=shape)
        return g.node("Mul", [d, c], "/lm_head/softcap/Mul", out_type=t, out_shape=shape)
