"""Granite-MoE ("granitemoe") and Granite-MoE-Shared ("granitemoeshared"): Granite's four multipliers
(granite.py: embedding, residual on each sublayer, attention scale, logits / logits_scaling) with the MLP block
replaced by routed experts, and for granitemoeshared a dense shared expert beside them.

Routed experts (HF GraniteMoeMoE): router logits [T, E] = x @ W_router^T (no bias); HF takes the top-k logits
and a softmax over those k, which equals a softmax over all E, top-k, renormalized over the k: one
com.microsoft::MoE node with normalize_routing_weights=1 (`moe.softmax_moe`). Experts gate_up_proj [E, 2I, H]
(rows [gate | up]) and down_proj [E, H, I]: silu(gate) * up -> down (SwiGLU, fc1 written interleaved).

Shared expert (HF GraniteMoeSharedMLP, when shared_intermediate_size > 0): input_linear [2S, H] (rows
[gate | up]) -> act(gate) * up -> output_linear [H, S], added to the routed output before the residual
multiplier: h + m * (moe(x) + shared(x))."""

from __future__ import annotations

from ..graph import gated_mlp
from ..moe import Experts, add, router_logits, softmax_moe
from .base import ExportContext
from .granite import GraniteFamily


class GraniteMoeFamily(GraniteFamily):
    name = "granitemoe"
    model_types = ("granitemoe", "granitemoeshared")
    features = GraniteFamily.features[:-1] + (
        "attention biases", "MoE as com.microsoft::MoE (softmax over the top-k logits == softmax, top-k, "
        "renormalized; SwiGLU experts)", "granitemoeshared: dense shared expert added to the routed output")

    def ffn(self, ctx: ExportContext, i: int, layer, x: str) -> str:
        g, config = ctx.g, ctx.config
        p, ip = f"/model/layers.{i}/moe", f"model.layers.{i}.moe"
        moe = layer.block_sparse_moe
        logits = router_logits(g, x, moe.router.weight, None, p, ip, float32=False)  # [T, E], as HF's F.linear
        ex = Experts.fused(moe.experts.gate_up_proj, moe.experts.down_proj, config.hidden_act)
        y = softmax_moe(g, x, logits, ex, int(moe.router.top_k), p, ip, normalize=self.normalize_routing(config))
        shared = getattr(layer, "shared_mlp", None)
        if shared is None:
            return y
        gate, up = shared.input_linear.weight.chunk(2, dim=0)  # [2S, H] -> [S, H] each
        sp, sip = f"/model/layers.{i}/shared_mlp", f"model.layers.{i}.shared_mlp"
        s = gated_mlp(g, x, (gate, None), (up, None), (shared.output_linear.weight, None), config.hidden_act, i,
                      prefix=sp, init_prefix=sip)
        return add(g, y, s, f"{sp}/Add")

    def normalize_routing(self, config) -> bool:
        """HF's softmax over the k chosen logits: the routing weights sum to 1."""
        return True
