"""OLMoE: a Llama-shaped pre-norm decoder with OLMo 2's QK-norm over the whole projection (q_norm [Hq * D],
k_norm [Hkv * D], in the graph before the node: `olmo2.whole_qk_norm`), optional `clip_qkv` (Q / K after their
norms and V clamped to [-clip, clip]: Clip nodes), and a routed-expert MLP as one com.microsoft::MoE node.

Routing (HF OlmoeTopKRouter): router logits = x @ W^T in the activation dtype (F.linear, no bias), softmax in
float32 over all experts, top-k, renormalized over the k when `norm_topk_prob`; the experts are SwiGLU on a fused
gate_up_proj [E, 2I, H] ([gate | up] rows) and down_proj [E, H, I]. The node computes exactly that (softmax over the
logits, top-k, normalize_routing_weights = norm_topk_prob)."""

from __future__ import annotations

from ..moe import Experts, router_logits, softmax_moe
from .base import DecoderFamily, ExportContext
from .olmo2 import whole_qk_norm


class OlmoeFamily(DecoderFamily):
    name = "olmoe"
    model_types = ("olmoe",)
    features = DecoderFamily.features + (
        "QK-norm over the whole projection (in the graph, before the node)", "clip_qkv (Clip on Q / K / V)",
        "softmax top-k routed SwiGLU experts as com.microsoft::MoE (norm_topk_prob)")

    def project_qkv(self, ctx, i, attn, x):
        return whole_qk_norm(self, ctx, i, attn, x, clip=ctx.config.clip_qkv)

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        g, gate = ctx.g, mlp.gate
        p, ip = f"/model/layers.{i}/moe", f"model.layers.{i}.moe"
        logits = router_logits(g, x, gate.weight, None, p, ip, float32=False)  # [T, E], as F.linear in HF
        ex = Experts.fused(mlp.experts.gate_up_proj, mlp.experts.down_proj, ctx.config.hidden_act)
        return softmax_moe(g, x, logits, ex, gate.top_k, p, ip, normalize=bool(gate.norm_topk_prob))
