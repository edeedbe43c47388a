"""Llama 4 text (model_type llama4_text, Llama4ForCausalLM: also what AutoModelForCausalLM builds from a
multimodal `llama4` checkpoint folder). What it adds to the Llama graph, and how:

- RoPE layers (`no_rope_layers[i] == 1`): RoPE in the node on complex pairs (2i, 2i + 1) (rotary_interleaved=1),
  cos / sin = the real / imaginary parts of the model's own freqs_cis (llama3 scaling included). HF normalizes
  q and k AFTER RoPE with a weightless per-head RMSNorm (`use_qk_norm`, eps rms_norm_eps); RoPE rotates pairs
  within a head, keeping its mean square, so the two commute: the norm is the node's QK-norm (before RoPE) with
  all-ones q_norm_weight / k_norm_weight. (Exact with exact tables; the node's T-rounded cos / sin are not an
  exact rotation, so the orders then differ at that rounding: 1.9e-3 x max|ref| of the tiny test's fp32 logits.)
- Chunked attention (`chunked_attention` layers of layer_types): a query at position p sees keys
  [floor(p / C) * C, p], C = attention_chunk_size. Context <= C: that is plain causal, nothing added (the graph
  runs on onnxruntime's PagedAttention). Longer contexts: the node's attention_bias (a pagedkit extension input),
  made once per step from each token's position (rope.chunk_bias): 0 inside the query's chunk, MASK before it;
  [B, 1, longest new-token count, longest KV extent] elements of T per step.
- NoPE layers (`no_rope_layers[i] == 0`): no RoPE, no QK-norm; with `attn_temperature_tuning` the query (its own
  Q product) times log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1 per token, in float32.
- Dense layers: gated MLP (intermediate_size_mlp). MoE layers (moe_layers): router logits in float32, top-1, the
  sigmoid of the chosen logit scales the expert INPUT (moe.input_scaled_moe: one com.microsoft::MoE node; experts
  gate_up [E, H, 2I] = [gate | up], down [E, I, H]), plus the shared expert.
- Context: max_position_embeddings is up to 10M (rotary tables of GBs): without --max-seq-len the context is
  min(max_position_embeddings, DEFAULT_CONTEXT = 8192, Scout's attention_chunk_size).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from onnx import TensorProto

from ..graph import cast
from ..moe import Experts, add, input_scaled_moe, router_logits, shared_expert, top_k
from ..rope import chunk_bias, rope_type, token_positions
from .base import DecoderFamily, ExportContext

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
DEFAULT_CONTEXT = 8192
MASK = -30000.0  # finite (a kernel tile with no key in the chunk never computes -inf - -inf); exp underflows to 0


class Llama4Family(DecoderFamily):
    name = "llama4"
    model_types = ("llama4_text", "llama4")
    features = ("RoPE (default, linear, llama3, YaRN) from the model's freqs_cis, interleaved pairs",
                "weightless QK-norm after RoPE (fused, all-ones gains)",
                "chunked attention: causal when context <= attention_chunk_size, else attention_bias from positions",
                "NoPE layers with per-position query temperature", "dense / MoE layers (top-1, sigmoid on the "
                "expert input, shared expert; com.microsoft::MoE)", "default context 8192",
                "a llama4 (multimodal) checkpoint folder: its text model")

    def check(self, config) -> None:
        if config.model_type == "llama4":
            raise NotImplementedError(
                "model_type 'llama4' (Llama4ForConditionalGeneration, vision + text): export its text model "
                "(AutoModelForCausalLM builds Llama4ForCausalLM, llama4_text, from the checkpoint folder)")
        if config.moe_layers and config.num_experts_per_tok != 1:
            raise NotImplementedError(f"num_experts_per_tok {config.num_experts_per_tok}: Llama 4 scales each "
                                      "expert's input by its router weight; one MoE node does that for top-1 only")
        if rope_type(config) == "longrope":
            raise NotImplementedError("rope_type 'longrope' on llama4_text: its tables switch with the length")

    def model_spec(self, model, opts):
        if opts.max_seq_len is None:
            opts = replace(opts, max_seq_len=min(model.config.max_position_embeddings, DEFAULT_CONTEXT))
        return super().model_spec(model, opts)

    # ---- attention ----------------------------------------------------------------------------
    def rope_key(self, config, i: int) -> str | None:
        return "cos_cache" if config.no_rope_layers[i] else None

    def rotary_interleaved(self, config) -> int:
        return 1  # torch.view_as_complex over (x0, x1), (x2, x3), ...

    @torch.no_grad()
    def rope_tables(self, model, max_positions: int):
        rot = self.decoder(model).rotary_emb
        rot = type(rot)(config=rot.config)  # float32 frequencies
        cis = rot(torch.zeros(1), torch.arange(max_positions)[None])[0]  # complex [P, D / 2]
        return {"cos_cache": (cis.real.float().contiguous(), cis.imag.float().contiguous())}

    def qk_norm(self, attn):
        norm = getattr(attn, "qk_norm", None)  # RoPE layers with use_qk_norm only
        if norm is None:
            return None
        ones = torch.ones(attn.head_dim)
        return ones, ones, float(norm.variance_epsilon)

    def project_qkv(self, ctx: ExportContext, i: int, attn, x: str):
        if ctx.config.no_rope_layers[i] or not ctx.config.attn_temperature_tuning:
            return super().project_qkv(ctx, i, attn, x)
        q, k, v = self.separate_qkv(ctx, i, attn, x)
        return self.temperature(ctx, i, q), k, v

    def temperature(self, ctx: ExportContext, i: int, q: str) -> str:
        """q [T, Hq * D] * (log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1) [T, 1], in float32."""
        g, config, p = ctx.g, ctx.config, f"/model/layers.{i}/attn/temperature"
        s = g.node("Cast", [token_positions(g, ctx.io)], f"{p}/Cast", to=F32, out_type=F32, out_shape=("num_tokens",))
        for j, (op, c) in enumerate((("Add", 1.0), ("Div", config.floor_scale), ("Floor", None), ("Add", 1.0),
                                     ("Log", None), ("Mul", config.attn_scale), ("Add", 1.0))):
            ins = [s] if c is None else [s, g.const(float(c), F32)]
            s = g.node(op, ins, f"{p}/{op}_{j}", out_type=F32, out_shape=("num_tokens",))
        s = g.node("Unsqueeze", [s, g.const([1], I64)], f"{p}/Unsqueeze", out_type=F32, out_shape=("num_tokens", 1))
        y = g.node("Mul", [cast(g, q, F32, f"{p}/q/Cast"), s], f"{p}/Mul", out_type=F32, out_shape=g.shape_of(q))
        return cast(g, y, g.float_type, f"{p}/out/Cast")

    def attention_bias(self, ctx: ExportContext, i: int) -> str | None:
        chunk = ctx.config.attention_chunk_size
        if ctx.config.layer_types[i] != "chunked_attention" or ctx.spec.context_length <= chunk:
            return None
        return chunk_bias(ctx.g, ctx.io, int(chunk), MASK)

    # ---- layers -------------------------------------------------------------------------------
    def ffn(self, ctx: ExportContext, i: int, layer, x: str) -> str:
        ff = layer.feed_forward
        return self.moe(ctx, i, ff, x) if hasattr(ff, "router") else self.mlp(ctx, i, ff, x)

    def moe(self, ctx: ExportContext, i: int, ff, x: str) -> str:
        """shared_expert(x) + expert_e(x * sigmoid(l_e)), e = argmax of the router logits l [T, E]."""
        g, act = ctx.g, ctx.config.hidden_act
        p, ip = f"/model/layers.{i}/moe", f"model.layers.{i}.moe"
        top, idx = top_k(g, router_logits(g, x, ff.router.weight, None, p, ip), 1, f"{p}/router")  # [T, 1]
        w = g.node("Sigmoid", [top], f"{p}/router/Sigmoid", out_type=F32, out_shape=g.shape_of(top))
        gate, up = ff.experts.gate_up_proj.detach().chunk(2, dim=-1)  # [E, H, I] each
        ex = Experts(up=up.transpose(1, 2), gate=gate.transpose(1, 2), act=act,
                     down=ff.experts.down_proj.detach().transpose(1, 2))  # [E, I, H], [E, H, I]
        routed = input_scaled_moe(g, x, idx, w, ex, p, ip)
        return add(g, routed, shared_expert(g, x, ff.shared_expert, act, i), f"{p}/Add")
