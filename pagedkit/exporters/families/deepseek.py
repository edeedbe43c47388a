"""DeepSeek V2 / V3 (model_type deepseek_v2 / deepseek_v3): Multi-head Latent Attention exported in absorbed
form through one PagedAttention node with kv_cache_layout="LATENT" (design §12), and the MoE MLP.

Attention of layer i (T tokens, H heads, rank = kv_lora_rank, rope = qk_rope_head_dim, nope =
qk_nope_head_dim, dv = v_head_dim; W_UK [H, nope, rank] and W_UV [H, dv, rank] are the two halves of each
head's rows of kv_b_proj):
  q        [T, H*(nope+rope)] = q_proj(x)  or  q_b_proj(RMSNorm_q_a(q_a_proj(x)))    (q_lora_rank)
  q_nope   [T, H, nope], q_pe [T, H, rope]                                          (split per head)
  q_abs    [T, H, rank] = q_nope[h] @ W_UK[h]          (batched MatMul over heads: W_UK absorbed into Q)
  query    [T, H*(rank+rope)] = q_abs ‖ q_pe
  latent   [T, rank + rope] = kv_a_proj_with_mqa(x);  key [T, 1*(rank+rope)] = RMSNorm_kv_a(c) ‖ k_pe
  PagedAttention: LATENT, kv_num_heads 1, head_size rank+rope, v_head_size rank, do_rotary 1 with
      rotary_offset = rank (RoPE on the trailing rope channels of Q and K, cos/sin [P, rope/2]),
      rotary_interleaved as the model rotates (V2: complex pairs = interleaved; V3: `rope_interleave`),
      scale = the model's softmax_scale (YaRN mscale^2 / sqrt(nope + rope), never 1/sqrt(rank + rope)).
      Cache past_key_values.{i}.key [num_blocks, block_size, 1, rank + rope]; no value cache.
  o_lat    [T, H*rank] -> o [T, H*dv] = o_lat[h] @ W_UV[h]^T (batched MatMul: W_UV after the op) -> o_proj
V3's interleaved RoPE returns its pairs de-interleaved ([evens | odds]); Q and K get the same permutation,
so the scores equal the interleaved rotation's and the cache simply holds k_pe interleaved.

MLP: the first `first_k_dense_replace` layers are dense (gated MLP); the others are MoE with shared
experts. Routing is computed exactly as Hugging Face does:
- V2 `greedy` (softmax over all experts, top-k, weights not renormalized — HF's DeepseekV2 ignores
  norm_topk_prob — times routed_scaling_factor): com.microsoft::MoE (router logits computed in float32,
  SwiGLU with alpha 1 / beta 0 / no limit == silu(gate) * up), the scaling factor a Mul after it;
- everything else (V2 `group_limited_greedy`; V3: sigmoid scores, + e_score_correction_bias for the
  choice, groups ranked by the sum of their top-2 choice scores, topk_group groups kept, top-k of the
  rest, weights = the scores of the chosen experts, renormalized when norm_topk_prob, times
  routed_scaling_factor): the choice in plain ONNX ops in float32 (experts idx [T, k], weights w [T, k]),
  fed to the same com.microsoft::MoE node through `moe.routed_moe` (router logits log(w) at the chosen
  experts, -inf elsewhere, the output times sum(w)): only the chosen experts are computed.
"""

from __future__ import annotations

from typing import Any

import torch
from onnx import TensorProto

from ..attention import paged_attention
from ..graph import GraphBuilder, cast, linear, rms_norm, rotary_tables
from ..moe import Experts, routed_moe, sigmoid_group_route, softmax_group_route, softmax_moe
from .base import DecoderFamily, ExportContext, ExportOptions

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


class DeepseekFamily(DecoderFamily):
    name = "deepseek"
    model_types = ("deepseek_v2", "deepseek_v3")
    features = ("MLA absorbed into PagedAttention LATENT (one [blocks, block_size, 1, rank + rope] cache)",
                "q_lora_rank (q_a_proj -> RMSNorm -> q_b_proj) or q_proj",
                "RoPE offset to the latent's rope channels, interleaved as the model rotates, YaRN",
                "softmax scale with YaRN mscale^2 (explicit node scale)",
                "MoE with shared experts in com.microsoft::MoE: V2 greedy softmax routing natively; group-limited / "
                "sigmoid (V3, e_score_correction_bias) routing chosen in plain ONNX ops and fed to the node",
                "first_k_dense_replace dense layers")

    # ---- per-model facts ---------------------------------------------------------------------
    def check(self, config) -> None:
        super().check(config)
        if config.num_key_value_heads != config.num_attention_heads:
            raise NotImplementedError(
                f"num_key_value_heads {config.num_key_value_heads} != num_attention_heads "
                f"{config.num_attention_heads}: Hugging Face's MLA expands the latent to one K/V per query head")
        rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
        if rank % 8 or rope % 2 or (rank + rope) % 8:
            raise NotImplementedError(f"kv_lora_rank {rank} must be a multiple of 8 (rotary_offset) and "
                                      f"kv_lora_rank + qk_rope_head_dim {rank + rope} a multiple of 8 (head_size)")
        if config.model_type == "deepseek_v2" and getattr(config, "topk_method", "greedy") not in (
                "greedy", "group_limited_greedy"):
            raise NotImplementedError(f"deepseek_v2 topk_method {config.topk_method!r}: Hugging Face's "
                                      "DeepseekV2 routes with 'greedy' or 'group_limited_greedy' only")

    def latent_width(self, config) -> int:
        return config.kv_lora_rank + config.qk_rope_head_dim

    def rotary_interleaved(self, config) -> int:
        if config.model_type == "deepseek_v2":  # torch.view_as_complex over (x0, x1), (x2, x3), ...
            return 1
        return int(bool(getattr(config, "rope_interleave", True)))

    def rope_tables(self, model, max_positions: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        rot, config = self.decoder(model).rotary_emb, model.config
        if config.model_type != "deepseek_v2":
            cos, sin = rotary_tables(rot, max_positions)
        else:  # V2's module returns freqs_cis = attention_scaling * exp(i pos inv_freq): [1, P, rope / 2] complex
            rot = type(rot)(config=rot.config)  # float32 inverse frequencies, whatever the model's dtype
            pos = torch.arange(max_positions, dtype=torch.int64)[None, :]
            freqs = rot(torch.zeros(1, dtype=torch.float32), pos)[0]
            cos, sin = freqs.real.float().contiguous(), freqs.imag.float().contiguous()
        if 2 * cos.shape[1] != config.qk_rope_head_dim:
            raise NotImplementedError(f"the rotary module's table covers {2 * cos.shape[1]} channels, not "
                                      f"qk_rope_head_dim {config.qk_rope_head_dim} (config.head_dim "
                                      f"{getattr(config, 'head_dim', None)})")
        return {"cos_cache": (cos, sin)}

    def model_spec(self, model, opts: ExportOptions):
        spec = super().model_spec(model, opts)
        config, kv = model.config, opts.kv
        if kv.rotate:
            raise ValueError("--rotate-kv: qk_rotation / v_rotation are rejected with kv_cache_layout LATENT "
                             "(DeepSeek's absorbed MLA)")
        v_set = kv.v_dtype or kv.v_quant != "NONE"
        if v_set and (kv.v_dtype, kv.v_quant) != (kv.k_dtype, kv.k_quant):  # --kv-* set both alike: fine
            raise ValueError("DeepSeek exports one LATENT cache per layer (K); set its dtype / quantization with "
                             "--kv-cache / --kv-quant or --k-*, not --v-*")
        width = self.latent_width(config)
        for l in spec.layers:
            l.layout, l.kv_num_heads, l.head_size, l.v_head_size, l.v_cache = "LATENT", 1, width, \
                config.kv_lora_rank, None
        spec.kv_num_heads, spec.head_size = 1, width
        return spec

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, ctx: ExportContext, i: int, attn, x: str) -> str:
        g, l, config = ctx.g, ctx.spec.layers[i], ctx.config
        p, ip = f"/model/layers.{i}/attn", f"model.layers.{i}.attn"
        heads, rank, rope = l.num_heads, config.kv_lora_rank, config.qk_rope_head_dim
        nope, dv = config.qk_nope_head_dim, config.v_head_dim
        rows = g.shape_of(x)[0]

        # query [T, H*(nope+rope)] -> q_abs ‖ q_pe [T, H*(rank+rope)]
        if attn.q_lora_rank is None:
            q = linear(g, x, attn.q_proj.weight, attn.q_proj.bias, f"{p}/q_proj", f"{ip}.q_proj")
        else:
            q = linear(g, x, attn.q_a_proj.weight, attn.q_a_proj.bias, f"{p}/q_a_proj", f"{ip}.q_a_proj")
            q = rms_norm(g, q, self.norm_weight(attn.q_a_layernorm), self.norm_eps(attn.q_a_layernorm),
                         f"{p}/q_a_layernorm", f"{ip}.q_a_layernorm.weight")
            q = linear(g, q, attn.q_b_proj.weight, attn.q_b_proj.bias, f"{p}/q_b_proj", f"{ip}.q_b_proj")
        q = reshape(g, q, [-1, heads, nope + rope], (rows, heads, nope + rope), f"{p}/q/Reshape")
        q_nope, q_pe = split(g, q, [nope, rope], -1, f"{p}/q/Split")
        w_kv = attn.kv_b_proj.weight.detach().reshape(heads, nope + dv, rank)  # per head [k_nope rows | v rows]
        w_uk = g.initializer(f"{ip}.kv_b_proj.W_UK", w_kv[:, :nope, :])  # [H, nope, rank]
        q_abs = head_matmul(g, q_nope, w_uk, rank, f"{p}/q_absorb")  # [T, H, rank]
        query = g.node("Concat", [q_abs, q_pe], f"{p}/query/Concat", axis=-1, out_type=g.float_type,
                       out_shape=(rows, heads, rank + rope))
        query = reshape(g, query, [-1, heads * (rank + rope)], (rows, heads * (rank + rope)), f"{p}/query/Reshape")

        # key [T, rank+rope] = RMSNorm(compressed_kv) ‖ k_pe (RoPE'd by the node, channels rank..)
        kv_a = attn.kv_a_proj_with_mqa
        latent = linear(g, x, kv_a.weight, kv_a.bias, f"{p}/kv_a_proj_with_mqa", f"{ip}.kv_a_proj_with_mqa")
        c, k_pe = split(g, latent, [rank, rope], -1, f"{p}/kv_a/Split")
        c = rms_norm(g, c, self.norm_weight(attn.kv_a_layernorm), self.norm_eps(attn.kv_a_layernorm),
                     f"{p}/kv_a_layernorm", f"{ip}.kv_a_layernorm.weight")
        key = g.node("Concat", [c, k_pe], f"{p}/key/Concat", axis=-1, out_type=g.float_type,
                     out_shape=(rows, rank + rope))

        attrs: dict[str, Any] = dict(num_heads=heads, kv_num_heads=1, scale=self.attention_scale(attn, config),
                                     kv_cache_layout="LATENT", v_head_size=rank, do_rotary=1,
                                     rotary_offset=rank, rotary_interleaved=self.rotary_interleaved(config))
        extra: dict[str, str] = {}
        caches = self.cache_io(ctx, l, extra, attrs)
        out = paged_attention(g, layer=i, io=ctx.io, query=query, key=key, value=None, caches=caches,
                              windowed_table=False, rope=ctx.rope[l.rope], extra_inputs=extra, attrs=attrs,
                              out_width=heads * rank)

        # o_lat [T, H*rank] -> per head @ W_UV^T -> [T, H*dv] -> o_proj
        o = reshape(g, out, [-1, heads, rank], (rows, heads, rank), f"{p}/o_lat/Reshape")
        w_uv = g.initializer(f"{ip}.kv_b_proj.W_UV_T", w_kv[:, nope:, :].transpose(1, 2))  # [H, rank, dv]
        o = head_matmul(g, o, w_uv, dv, f"{p}/v_up")
        o = reshape(g, o, [-1, heads * dv], (rows, heads * dv), f"{p}/v_up/Reshape")
        return linear(g, o, attn.o_proj.weight, attn.o_proj.bias, f"{p}/o_proj", f"{ip}.o_proj")

    # ---- MLP / MoE ----------------------------------------------------------------------------
    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        if not hasattr(mlp, "experts"):  # first_k_dense_replace layers
            return super().mlp(ctx, i, mlp, x)
        g, config = ctx.g, ctx.config
        p, ip = f"/model/layers.{i}/mlp", f"model.layers.{i}.mlp"
        ex = Experts.fused(mlp.experts.gate_up_proj, mlp.experts.down_proj, config.hidden_act)
        logits = self.router_logits(ctx, mlp, x, p, ip)
        k = int(config.num_experts_per_tok)
        if self.moe_op_fits(config):  # V2 greedy: the node's own softmax routing
            routed = softmax_moe(g, x, logits, ex, k, p, ip, normalize=False, scale=float(config.routed_scaling_factor))
        else:
            idx, w = self.route(ctx, mlp, logits, p, ip)
            routed = routed_moe(g, x, idx, w, ex, p, ip)
        shared = super().mlp(ctx, i, mlp.shared_experts, x)  # /model/layers.{i}/mlp/{gate,up,down}_proj
        return g.node("Add", [routed, shared], f"{p}/shared/Add", out_type=g.float_type, out_shape=g.shape_of(x))

    def moe_op_fits(self, config) -> bool:
        """com.microsoft::MoE routes by softmax over all experts + top-k: Hugging Face's DeepseekV2 'greedy'."""
        return config.model_type == "deepseek_v2" and config.topk_method == "greedy"

    def router_logits(self, ctx: ExportContext, mlp, x: str, p: str, ip: str) -> str:
        """[T, E] float32, as Hugging Face (float32 gate weight, float32 hidden states)."""
        g = ctx.g
        w = g.initializer(f"{ip}.gate.weight", mlp.gate.weight.detach().float().t(), F32)
        x32 = cast(g, x, F32, f"{p}/gate/Cast")
        return g.node("MatMul", [x32, w], f"{p}/gate/MatMul", out_type=F32,
                      out_shape=(g.shape_of(x)[0], mlp.gate.weight.shape[0]))

    def route(self, ctx: ExportContext, mlp, logits: str, p: str, ip: str) -> tuple[str, str]:
        """(idx [T, k] int64, w [T, k] float32): each token's experts and routing weights, as Hugging Face
        (moe.sigmoid_group_route for V3, moe.softmax_group_route for V2's group_limited_greedy)."""
        config = ctx.config
        k, scale = int(config.num_experts_per_tok), float(config.routed_scaling_factor)
        if config.model_type != "deepseek_v2":
            return sigmoid_group_route(ctx.g, logits, mlp.gate.e_score_correction_bias, k, int(config.n_group),
                                       int(config.topk_group), norm=bool(config.norm_topk_prob), scale=scale, p=p,
                                       ip=ip)
        if config.topk_method not in ("greedy", "group_limited_greedy"):  # what Hugging Face's V2 gate routes
            raise NotImplementedError(f"DeepSeek-V2 topk_method {config.topk_method!r} is not supported "
                                      "(greedy, group_limited_greedy)")
        grouped = config.topk_method == "group_limited_greedy"
        return softmax_group_route(ctx.g, logits, k, int(config.n_group) if grouped else None,
                                   int(config.topk_group) if grouped else None, scale=scale, p=p)


# ---- small graph pieces ---------------------------------------------------------------------------

def reshape(g: GraphBuilder, x: str, shape: list[int], out_shape: tuple, name: str) -> str:
    return g.node("Reshape", [x, g.const(shape, I64)], name, out_type=g.vi[x][0], out_shape=out_shape)


def split(g: GraphBuilder, x: str, sizes: list[int], axis: int, name: str) -> list[str]:
    """Split x along `axis` into pieces of `sizes` (outputs `{name}/output_{j}`)."""
    elem, shape = g.vi[x]
    outs = [f"{name}/output_{j}" for j in range(len(sizes))]
    g.node("Split", [x, g.const(sizes, I64)], name, outputs=outs, axis=axis)
    ax = axis % len(shape)
    for o, n in zip(outs, sizes):
        g.vi[o] = (elem, tuple(shape[:ax]) + (n,) + tuple(shape[ax + 1:]))
    return outs


def head_matmul(g: GraphBuilder, x: str, weight: str, width: int, prefix: str) -> str:
    """Per-head projection: x [T, H, a] with weight [H, a, b] -> [T, H, b] (Transpose, MatMul, Transpose)."""
    rows, heads, _ = g.shape_of(x)
    t = g.node("Transpose", [x], f"{prefix}/Transpose", perm=[1, 0, 2], out_type=g.float_type,
               out_shape=(heads, rows, g.shape_of(x)[2]))
    y = g.node("MatMul", [t, weight], f"{prefix}/MatMul", out_type=g.float_type, out_shape=(heads, rows, width))
    return g.node("Transpose", [y], f"{prefix}/Transpose_1", perm=[1, 0, 2], out_type=g.float_type,
                  out_shape=(rows, heads, width))


