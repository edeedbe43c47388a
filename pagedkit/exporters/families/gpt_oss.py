"""GPT-OSS: attention sinks (node `head_sink`), alternating sliding (window from the HF module, 128 in the
real model) / full layers (sliding layers read `block_table_windowed`, as onnxruntime-genai), biased
Q/K/V/O projections, YaRN RoPE with its attention factor folded into cos/sin by the model's own rotary
module (GPT-OSS's module returns the half-width table), and the MoE MLP as com.microsoft::MoE (as
onnxruntime-genai): router logits [T, E] (softmax over all experts, top-k, renormalized == HF's softmax
over the top-k logits), fc1 = gate_up [E, 2I, H] interleaved (swiglu_fusion=1), fc2 = down [E, H, I],
SwiGLU with alpha / limit and beta = 1 ((up + 1) * gate * sigmoid(alpha * gate))."""

from __future__ import annotations

from ..graph import MS_DOMAIN, linear, rotary_tables
from .base import DecoderFamily, ExportContext


class GptOssFamily(DecoderFamily):
    name = "gpt_oss"
    model_types = ("gpt_oss",)
    features = DecoderFamily.features + (
        "attention sinks (head_sink)", "alternating sliding / full layers", "biased projections",
        "YaRN folded into cos/sin", "MoE as com.microsoft::MoE (SwiGLU, interleaved gate/up)")

    def rope_tables(self, model, max_positions):
        return {"cos_cache": rotary_tables(self.decoder(model).rotary_emb, max_positions, duplicated=False)}

    def head_sink(self, attn):
        return attn.sinks

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        g = ctx.g
        p, ip = f"/model/layers.{i}/moe", f"model.layers.{i}.moe"
        router = mlp.router
        logits = linear(g, x, router.weight, router.bias, f"{p}/router", f"{ip}.router")
        ex = mlp.experts
        fc1 = g.initializer(f"{ip}.experts.gate_up_proj.weight", ex.gate_up_proj.detach().transpose(1, 2))
        fc1_b = g.initializer(f"{ip}.experts.gate_up_proj.bias", ex.gate_up_proj_bias.detach())
        fc2 = g.initializer(f"{ip}.experts.down_proj.weight", ex.down_proj.detach().transpose(1, 2))
        fc2_b = g.initializer(f"{ip}.experts.down_proj.bias", ex.down_proj_bias.detach())
        return g.node("MoE", [x, logits, fc1, fc1_b, fc2, fc2_b], f"{p}/MoE", domain=MS_DOMAIN,
                      k=int(router.top_k), activation_type="swiglu", swiglu_fusion=1,
                      activation_alpha=float(ex.alpha), activation_beta=1.0, swiglu_limit=float(ex.limit),
                      normalize_routing_weights=1, use_sparse_mixer=0,
                      out_type=g.float_type, out_shape=g.shape_of(x))
