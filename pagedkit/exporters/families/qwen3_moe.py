"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (per-head QK RMSNorm fused into the node:
q_norm_weight / k_norm_weight, qk_norm_epsilon; `attention_bias` packed into the QKV bias; `sliding_window`
on every layer when use_sliding_window) and the softmax-routed MoE of families/mixtral.py's `SoftmaxMoE`
(top-k renormalized when `norm_topk_prob`, true in the published configs), no shared expert. Layers listed in
`mlp_only_layers`, or with (i + 1) % decoder_sparse_step != 0, are dense gated MLPs (intermediate_size)."""

from __future__ import annotations

from .base import DecoderFamily
from .mixtral import SoftmaxMoE
from .qwen3 import Qwen3Family


class Qwen3MoeFamily(SoftmaxMoE, Qwen3Family):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    features = DecoderFamily.features + (
        "QK-norm fused (q_norm_weight / k_norm_weight)", "sliding window on every layer (use_sliding_window)",
        "softmax top-k MoE in com.microsoft::MoE (renormalized per norm_topk_prob, float32 router)",
        "dense layers (mlp_only_layers, decoder_sparse_step)")
