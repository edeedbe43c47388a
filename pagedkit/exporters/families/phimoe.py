"""PhiMoE (Phi-3.5-MoE, model_type phimoe): Mixtral-shaped MoE with LayerNorm (weight and bias) for every norm
(base `norm`: SkipLayerNormalization / LayerNormalization), biased Q / K / V / O projections and LM head,
LongRoPE (base `rope_tables`: the rotary module's short / long tables, switched per step by the batch's longest
sequence; transformers' PhimoeRotaryEmbedding scales by short_mscale / long_mscale and, as of transformers 5.25,
keeps the short factors past original_max_position_embeddings too: the tables follow that module), a sliding
window on every layer from `config.sliding_window` (HF's mask; the attention module has no attribute), and
sparsemixer routing.

Hugging Face's `sparsemixer` in eval mode (2 experts whatever num_experts_per_tok says, jitter_eps =
router_jitter_noise) on the router logits s [T, E] (float32 here: the router in float32 on the normed input):
  e1 = argmax s, m1 = s[e1];  mask1_j = (m1 - s_j) / max(|s_j|, m1) > 2 eps;  w1 = 1 / sum_{j not masked} exp(s_j - m1)
  e2 = argmax of s without e1, m2 its logit; mask2 the same with m2, e1 masked too;  w2 likewise
The graph computes exactly that in standard ops (float32: TopK, Div, Greater, Where, Exp, ReduceSum) and feeds
(e, w) to com.microsoft::MoE through `moe.routed_moe` (the weights do not sum to 1: the node's output is
scaled by w1 + w2). It does not use the node's use_sparse_mixer=1: onnxruntime's CPU MoE (1.32) accepts and
ignores that attribute (softmax top-2), its CUDA kernel takes 8 or 16 experts and a constant jitter 0.01.
Experts: fused gate_up [E, 2I, H] ([gate | up]) and down [E, H, I], SiLU-gated (swiglu, interleaved fc1).
"""

from __future__ import annotations

from onnx import TensorProto

from ..graph import GraphBuilder
from ..moe import Experts, router_logits, routed_moe, top_k
from .base import DecoderFamily, ExportContext

F32, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


class PhimoeFamily(DecoderFamily):
    name = "phimoe"
    model_types = ("phimoe",)
    features = DecoderFamily.features + (
        "LayerNorm with bias", "q / k / v / o and LM head biases", "LongRoPE with short / long mscale",
        "sliding window on every layer", "sparsemixer top-2 routing (float32, standard ops) fed to "
        "com.microsoft::MoE", "fused gate_up experts (SwiGLU)")

    def check(self, config) -> None:
        if config.num_local_experts < 2:
            raise NotImplementedError(f"num_local_experts {config.num_local_experts}: PhiMoE's sparsemixer "
                                      "routes 2 experts")

    def layer_window(self, config, i: int, attn) -> int:
        w = getattr(config, "sliding_window", None)
        return int(w) if w else -1

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        g, config = ctx.g, ctx.config
        p, ip = f"/model/layers.{i}/mlp", f"model.layers.{i}.mlp"
        ex = Experts.fused(mlp.experts.gate_up_proj, mlp.experts.down_proj, config.hidden_act)
        logits = router_logits(g, x, mlp.router.weight, mlp.router.bias, p, ip)  # [T, E] float32
        idx, w = self.route(g, logits, float(mlp.router.router_jitter_noise), p)
        return routed_moe(g, x, idx, w, ex, p, ip)

    @staticmethod
    def route(g: GraphBuilder, s: str, eps: float, p: str) -> tuple[str, str]:
        """HF's sparsemixer (eval) on s [T, E] float32: (experts [T, 2] int64, weights [T, 2] float32)."""
        rows, n = g.shape_of(s)
        te, t1 = (rows, n), (rows, 1)

        def node(op, ins, name, out=F32, shape=te, **kw):
            return g.node(op, ins, f"{p}/mixer/{name}", out_type=out, out_shape=shape, **kw)

        mag = node("Abs", [s], "Abs")

        def one(scores: str, excluded: str | None, j: int) -> tuple[str, str]:
            top, e = top_k(g, scores, 1, f"{p}/mixer/{j}")  # [T, 1] logit m and expert of pass j
            ratio = node("Div", [node("Sub", [top, s], f"{j}/Sub"), node("Max", [mag, top], f"{j}/Max")], f"{j}/Div")
            mask = node("Greater", [ratio, g.const(2.0 * eps, F32)], f"{j}/Greater", out=BOOL)
            if excluded is not None:
                mask = node("Or", [mask, excluded], f"{j}/Or", out=BOOL)
            ex = node("Exp", [node("Sub", [s, top], f"{j}/Sub_1")], f"{j}/Exp")
            ex = node("Where", [mask, g.const(0.0, F32), ex], f"{j}/Where")
            total = node("ReduceSum", [ex, g.const([-1], I64)], f"{j}/ReduceSum", shape=t1, keepdims=1)
            return e, node("Reciprocal", [total], f"{j}/Reciprocal", shape=t1)

        e1, w1 = one(s, None, 1)
        first = node("Equal", [e1, g.const(list(range(n)), I64)], "first/Equal", out=BOOL)  # [T, E]: expert e1
        e2, w2 = one(node("Where", [first, g.const(float("-inf"), F32), s], "first/Where"), first, 2)
        idx = node("Concat", [e1, e2], "idx/Concat", out=I64, shape=(rows, 2), axis=1)
        return idx, node("Concat", [w1, w2], "w/Concat", shape=(rows, 2), axis=1)
