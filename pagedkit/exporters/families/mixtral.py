"""Mixtral: Mistral attention (`sliding_window` on every layer when set: the node's local_window_size, plain
block_table, as families/mistral.py) and a softmax-routed mixture of experts on every layer, one
com.microsoft::MoE node per layer.

Hugging Face (MixtralSparseMoeBlock): router logits x @ W_r^T [T, E], softmax over all E experts in float32,
top-k (num_experts_per_tok), the k weights always renormalized to sum 1; experts gate_up_proj [E, 2I, H]
(rows [gate | up]) and down_proj [E, H, I]: y = sum_j w_j down_e(silu(gate_e x) * up_e x).
Graph: router logits [T, E] in float32 (moe.router_logits), MoE node with k = num_experts_per_tok,
normalize_routing_weights 1, fc1 = gate / up interleaved [E, 2I, H] (swiglu_fusion 1), fc2 = down [E, H, I].

`SoftmaxMoE` is that block for every transformers family built from the same router / experts modules
(Mixtral, Qwen2-MoE, Qwen3-MoE): renormalization per `normalize_routing` (Qwen: norm_topk_prob), an optional
shared expert scaled by a per-token sigmoid gate, and the dense layers of `moe_layer` (Hugging Face's
mlp_only_layers / decoder_sparse_step rule), exported as the base family's gated MLP."""

from __future__ import annotations

from ..moe import Experts, add, router_logits, shared_expert, softmax_moe
from .base import ExportContext
from .mistral import MistralFamily


class SoftmaxMoE:
    """Mixin, listed before the attention family: the `mlp` hook of transformers' softmax-top-k sparse blocks
    (`gate`: a TopKRouter with weight [E, H] and top_k; `experts`: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""

    def normalize_routing(self, config) -> bool:
        """Whether the top-k weights are renormalized to sum 1 (Qwen2/3-MoE: norm_topk_prob)."""
        return bool(config.norm_topk_prob)

    def moe_layer(self, config, i: int) -> bool:
        """Hugging Face's Qwen2/3-MoE decoder-layer rule: layer i is sparse unless listed in mlp_only_layers,
        when num_experts > 0 and (i + 1) % decoder_sparse_step == 0; otherwise a dense gated MLP."""
        return (i not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
                and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0)

    def shared_expert(self, block):
        """(dense gated MLP, its per-token sigmoid gate Linear [1, H] or None) beside the routed experts, or None."""
        return None

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        sparse = self.moe_layer(ctx.config, i)
        if sparse != hasattr(mlp, "experts"):
            raise NotImplementedError(f"layer {i}: the dense-layer rule (mlp_only_layers / decoder_sparse_step) "
                                      f"says {'MoE' if sparse else 'dense'}, the model's module is "
                                      f"{type(mlp).__name__}")
        if not sparse:
            return super().mlp(ctx, i, mlp, x)
        g, act = ctx.g, ctx.config.hidden_act
        p, ip = f"/model/layers.{i}/mlp", f"model.layers.{i}.mlp"
        logits = router_logits(g, x, mlp.gate.weight, None, p, ip)  # [T, E] float32
        ex = Experts.fused(mlp.experts.gate_up_proj, mlp.experts.down_proj, act)
        y = softmax_moe(g, x, logits, ex, int(mlp.gate.top_k), p, ip, normalize=self.normalize_routing(ctx.config))
        shared = self.shared_expert(mlp)
        if shared is None:
            return y
        return add(g, y, shared_expert(g, x, shared[0], act, i, gate=shared[1]), f"{p}/shared/Add")


class MixtralFamily(SoftmaxMoE, MistralFamily):
    name = "mixtral"
    model_types = ("mixtral",)
    features = MistralFamily.features + ("softmax top-k MoE, renormalized, in com.microsoft::MoE "
                                         "(float32 router, SwiGLU experts interleaved)",)

    def normalize_routing(self, config) -> bool:
        return True  # MixtralTopKRouter always divides by the top-k sum

    def moe_layer(self, config, i: int) -> bool:
        return True  # every MixtralDecoderLayer holds a MixtralSparseMoeBlock
