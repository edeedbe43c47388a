"""GLM-4-MoE (model_type glm4_moe: GLM-4.5, GLM-4.5-Air): Llama-shaped attention with q / k / v biases
(attention_bias; none on o_proj), optional per-head QK RMSNorm before RoPE (use_qk_norm: fused into the node,
q_norm_weight / k_norm_weight), partial rotate_half RoPE (the rotary module's table covers head_dim *
partial_rotary_factor channels; the rest pass), and DeepSeek-V3's MoE.

MLP of layer i: the first `first_k_dense_replace` layers are a dense gated MLP; the others Glm4MoeMoE:
  router logits s = x @ W^T [T, E] in float32 (HF: float32 weight and hidden states);
  Glm4MoeTopkRouter: scores = sigmoid(s), choice = scores + e_score_correction_bias, groups (n_group) ranked by
  the sum of their top-2 choice scores, topk_group kept, top-k (num_experts_per_tok) of the choice, weights =
  the scores of the chosen experts, / (sum + 1e-20) when norm_topk_prob, x routed_scaling_factor:
  `moe.sigmoid_group_route` (shared with DeepSeek-V3) in float32 standard ops, fed to com.microsoft::MoE by
  `moe.routed_moe` (only the chosen experts computed); experts gate_up [E, 2I, H] ([gate | up]), down [E, H, I];
  + shared experts, a dense gated MLP of moe_intermediate_size * n_shared_experts.
"""

from __future__ import annotations

from ..moe import Experts, add, router_logits, routed_moe, shared_expert, sigmoid_group_route
from .base import DecoderFamily, ExportContext


class Glm4MoeFamily(DecoderFamily):
    name = "glm4_moe"
    model_types = ("glm4_moe",)
    features = DecoderFamily.features + (
        "q / k / v projection biases", "partial RoPE (partial_rotary_factor)", "QK-norm fused (use_qk_norm)",
        "MoE: sigmoid scores + e_score_correction_bias, group-limited top-k (n_group / topk_group), "
        "norm_topk_prob, routed_scaling_factor, chosen in float32 standard ops and fed to com.microsoft::MoE",
        "shared experts", "first_k_dense_replace dense layers")

    def check(self, config) -> None:
        if config.n_routed_experts % config.n_group:
            raise NotImplementedError(f"n_routed_experts {config.n_routed_experts} is not a multiple of n_group "
                                      f"{config.n_group}")
        if config.n_routed_experts // config.n_group < 2:
            raise NotImplementedError(f"n_group {config.n_group}: Hugging Face ranks a group by its top-2 scores, "
                                      "which needs >= 2 experts per group")

    def qk_norm(self, attn):
        return self.module_qk_norm(attn) if attn.use_qk_norm else None

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        if not hasattr(mlp, "experts"):  # layers < first_k_dense_replace: Glm4MoeMLP
            return super().mlp(ctx, i, mlp, x)
        g, config = ctx.g, ctx.config
        p, ip = f"/model/layers.{i}/mlp", f"model.layers.{i}.mlp"
        gate = mlp.gate
        logits = router_logits(g, x, gate.weight, None, p, ip)  # [T, E] float32
        idx, w = sigmoid_group_route(g, logits, gate.e_score_correction_bias, int(gate.top_k), int(gate.num_group),
                                     int(gate.topk_group), norm=bool(gate.norm_topk_prob),
                                     scale=float(gate.routed_scaling_factor), p=p, ip=ip)
        ex = Experts.fused(mlp.experts.gate_up_proj, mlp.experts.down_proj, config.hidden_act)
        routed = routed_moe(g, x, idx, w, ex, p, ip)
        shared = shared_expert(g, x, mlp.shared_experts, config.hidden_act, i, name="shared_experts")
        return add(g, routed, shared, f"{p}/shared/Add")
