"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (Q / K / V biases, `qkv_bias`, packed into the QKV product's
bias; sliding layers from `layer_types`) and the softmax-routed MoE of families/mixtral.py's `SoftmaxMoE`:
top-k renormalized only when `norm_topk_prob`, plus a shared expert (a dense gated MLP of
shared_expert_intermediate_size) scaled per token by sigmoid(shared_expert_gate(x)) [T, 1]:
  y = MoE(x) + sigmoid(x @ w_g^T) * shared_expert(x)   (moe.shared_expert(..., gate=...), then an Add).
Layers listed in `mlp_only_layers`, or with (i + 1) % decoder_sparse_step != 0, are dense gated MLPs
(intermediate_size)."""

from __future__ import annotations

from .mixtral import SoftmaxMoE
from .qwen2 import Qwen2Family


class Qwen2MoeFamily(SoftmaxMoE, Qwen2Family):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)
    features = Qwen2Family.features + (
        "softmax top-k MoE in com.microsoft::MoE (renormalized per norm_topk_prob, float32 router)",
        "shared expert scaled by sigmoid(shared_expert_gate)", "dense layers (mlp_only_layers, decoder_sparse_step)")

    def shared_expert(self, block):
        return block.shared_expert, block.shared_expert_gate
