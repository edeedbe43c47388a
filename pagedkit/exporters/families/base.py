"""The decoder-only family every exporter family specializes.

A family declares what it supports (`model_types`, `features`) and overrides the few hooks where its
architecture differs from Llama: how Q/K/V weights are laid out (`qkv_weights`), per-layer window
(`layer_window`), QK-norm, head sinks, softcaps, norm placement (`decoder_layer`), the MLP (`mlp`), the
embedding scale and the LM head. `build` walks the Hugging Face module tree and writes the graph with
the helpers of `graph.py`; the attention node comes from the contract's node builder.

Graph interface (onnxruntime-genai's paged layout, contract-decisions §5 and §8):
  input_ids [num_tokens] int64, block_table [batch_size, max_num_blocks] int32,
  block_table_windowed (windowed layers, when the model mixes windowed and full layers),
  cumulative_sequence_lengths [batch_size + 1], past_sequence_lengths [batch_size], attention_metadata [3],
  optional slot_mapping / query_positions [num_tokens] int32,
  past_key_values.{i}.key/value [num_blocks, block_size, kv_heads, head_size] -> present.{i}.key/value,
  PER_TOKEN: past_key_values.{i}.key_scale/value_scale [num_blocks, block_size, kv_heads] float16,
  logits [num_tokens, vocab] (float32 for bf16 models, as onnxruntime-genai, and for float32 models).

dtype fp32: float32 weights and activations everywhere; PagedAttention's T is float16 / bfloat16 only
(contract-decisions §6), so each node runs in float16 (bfloat16 with bfloat16 caches) between Casts
(`graph.paged_attention`), its T-typed constants (cos/sin, head_sink, q/k norm weights) are initializers of
that type, and the caches default to float16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from onnx import TensorProto

from ...interface import dtypes
from ...interface import names as N
from ...interface.genai_config import CacheSpec, LayerSpec, ModelSpec, genai_type_of
from ...validators.contract import cache_format, cache_width
from ..attention import GraphInputs, cache_io, paged_attention
from ..graph import GraphBuilder, Norm, Residual, cast, gated_mlp, linear, rotary_tables, scale
from ..rope import LongRope, check_context, longrope_tables, original_max_positions, rope_type, select_tables

FLOAT_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "fp32": TensorProto.FLOAT}
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}  # ModelSpec.dtype spellings


def attention_type(opts: "ExportOptions") -> int:
    """PagedAttention's T for these options: the export dtype, or for fp32 float16 (bfloat16 when the
    caches are bfloat16: unquantized caches hold T)."""
    if opts.dtype != "fp32":
        return FLOAT_TYPES[opts.dtype]
    return TensorProto.BFLOAT16 if "bfloat16" in (opts.kv.k_dtype, opts.kv.v_dtype) else TensorProto.FLOAT16


def cache_elem_type(cache_dtype: str) -> int:
    """ONNX element type of a cache tensor of k/v_cache_dtype `cache_dtype` (int4: UINT8), from the contract's
    cache-format table."""
    return dtypes.elem_type(cache_format(cache_dtype).storage)


@dataclass
class KVOptions:
    """Cache dtype / quantization per side ("" dtype = the activation dtype)."""

    k_dtype: str = ""
    v_dtype: str = ""
    k_quant: str = "NONE"
    v_quant: str = "NONE"
    rotate: bool = False  # qk_rotation and v_rotation


@dataclass
class ExportOptions:
    dtype: str = "fp16"  # activation / weight dtype: fp16 | bf16 | fp32 (attention in fp16 between Casts)
    block_size: int = 16
    max_seq_len: int | None = None  # rotary table length / context_length; default max_position_embeddings
    kv: KVOptions = field(default_factory=KVOptions)
    slot_mapping: bool = False  # add the optional pagedkit graph inputs (contract-decisions §8)
    query_positions: bool = False
    # static K/V scales per layer (PER_TENSOR [1] / PER_CHANNEL [kv_heads, 1, head_size], float32), from calibration
    kv_scales: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)
    progress: bool = True


class ExportContext:
    """What a family's hooks work with while one graph is built."""

    def __init__(self, family: "DecoderFamily", model: torch.nn.Module, opts: ExportOptions):
        self.family, self.model, self.opts = family, model, opts
        self.config = model.config
        self.g = GraphBuilder(FLOAT_TYPES[opts.dtype], attention_type(opts))
        self.io = GraphInputs(slot_mapping=N.SLOT_MAPPING if opts.slot_mapping else None,
                              query_positions=N.QUERY_POSITIONS if opts.query_positions else None)
        self.spec = family.model_spec(model, opts)
        self.rope: dict[str, tuple[str, str]] = {}


def _rows() -> str:
    return "num_tokens"


class DecoderFamily:
    """Llama-shaped decoder: pre-norm, Q/K/V/O projections, gated MLP, RMSNorm, RoPE."""

    name = "llama"
    model_types: tuple[str, ...] = ("llama",)
    # what the family supports, in words (for docs and `paged-export --list`)
    features: tuple[str, ...] = ("RoPE (default, linear, dynamic, llama3, YaRN, LongRoPE via the model's rotary "
                                 "module)", "GQA", "tied or separate LM head")

    # ---- per-model facts ---------------------------------------------------------------------
    def check(self, config) -> None:
        """Raise NotImplementedError for a configuration this family cannot export faithfully."""

    def decoder(self, model):
        return model.model

    def layers(self, model) -> list:
        return list(self.decoder(model).layers)

    def head_size(self, attn, config) -> int:
        return int(getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def layer_window(self, config, i: int, attn) -> int:
        """local_window_size of layer i (-1 = full). Default: what the HF attention module says."""
        w = getattr(attn, "sliding_window", None)
        return int(w) if w else -1

    def rope_key(self, config, i: int) -> str | None:
        return "cos_cache"

    def rope_in_node(self, config, i: int) -> bool:
        """Whether layer i's RoPE runs in the attention node (do_rotary=1). A family that must act after RoPE
        (a norm, a per-position query scale) returns False and rotates in `project_qkv` (rope.apply_rope)."""
        return True

    def rope_tables(self, model, max_positions: int) -> dict[str, "tuple[torch.Tensor, torch.Tensor] | LongRope"]:
        """key -> cos / sin tables [max_positions, rotary_dim / 2] (or a LongRope pair switched per step)."""
        rot, config = self.decoder(model).rotary_emb, model.config
        if rope_type(config) == "longrope":
            orig = original_max_positions(config)
            short, long = longrope_tables(rot, max_positions, orig)
            return {"cos_cache": short if long is None else LongRope(short, long, orig)}
        return {"cos_cache": rotary_tables(rot, max_positions)}

    def model_spec(self, model, opts: ExportOptions) -> ModelSpec:
        config = model.config
        self.check(config)
        act = DTYPE_NAMES[opts.dtype]
        default_cache = dtypes.numpy_name(attention_type(opts))  # the attention type: fp16 for fp32 exports
        layers = []
        for i, layer in enumerate(self.layers(model)):
            attn = layer.self_attn
            k = CacheSpec(opts.kv.k_dtype or default_cache, opts.kv.k_quant, opts.kv.rotate)
            v = CacheSpec(opts.kv.v_dtype or default_cache, opts.kv.v_quant, opts.kv.rotate)
            for c in (k, v):
                c.scale_dtype = "float16" if c.quant == "PER_TOKEN" else None
            layers.append(LayerSpec(layer=i, num_heads=config.num_attention_heads,
                                    kv_num_heads=config.num_key_value_heads, head_size=self.head_size(attn, config),
                                    window=self.layer_window(config, i, attn), k_cache=k, v_cache=v,
                                    rope=self.rope_key(config, i)))
        windowed = [l.window > 0 for l in layers]
        if any(windowed) and not all(windowed):  # onnxruntime-genai: a ring table for the windowed layers
            for l in layers:
                l.windowed_table = l.window > 0
            if opts.slot_mapping:
                raise ValueError("slot_mapping: this model's windowed layers read block_table_windowed (a "
                                 "second block pool); one slot_mapping input cannot address both pools")
        context = opts.max_seq_len or config.max_position_embeddings
        check_context(config, context)
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        return ModelSpec(
            model_type=genai_type_of(getattr(config, "architectures", None) or [type(model).__name__],
                                     config.model_type),
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, kv_num_heads=config.num_key_value_heads,
            head_size=layers[0].head_size, context_length=context, layers=layers, block_size=opts.block_size,
            dtype=act, bos_token_id=config.bos_token_id,
            eos_token_id=eos if eos is not None else config.eos_token_id,
            pad_token_id=config.pad_token_id,
            slot_mapping=N.SLOT_MAPPING if opts.slot_mapping else None,
            query_positions=N.QUERY_POSITIONS if opts.query_positions else None,
            rope=self.rope_info(config))

    def rope_info(self, config) -> dict[str, Any]:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        info = dict(rope) if isinstance(rope, dict) else {}
        if getattr(config, "rope_theta", None) is not None:
            info.setdefault("rope_theta", config.rope_theta)
        return {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool, list)) or v is None}

    # ---- weights ------------------------------------------------------------------------------
    def qkv_weights(self, attn) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed QKV projection: weight [(Hq + 2 Hkv) * D, hidden], bias or None."""
        ws = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        bs = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        bias = torch.cat([b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(ws, bs)]) \
            if any(b is not None for b in bs) else None
        return torch.cat(ws, 0), bias

    def norm_weight(self, norm) -> torch.Tensor:
        """The multiplicative RMSNorm gain (Gemma: 1 + w)."""
        return norm.weight.detach().float()

    def norm(self, norm) -> Norm:
        """The graph norm of a Hugging Face norm module: LayerNorm (with its bias) for torch.nn.LayerNorm
        subclasses, RMSNorm otherwise (gains through `norm_weight`)."""
        if isinstance(norm, torch.nn.LayerNorm):
            bias = norm.bias.detach().float() if norm.bias is not None else None
            return Norm(self.norm_weight(norm), self.norm_eps(norm), "layer", bias)
        return Norm(self.norm_weight(norm), self.norm_eps(norm))

    def norm_eps(self, norm) -> float:
        return float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps"))

    def qk_norm(self, attn) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Per-head QK RMSNorm fused into the node: (q gain [D], k gain [D], epsilon), or None."""
        return None

    def module_qk_norm(self, attn) -> tuple[torch.Tensor, torch.Tensor, float]:
        """`qk_norm` from the attention module's per-head q_norm / k_norm (gains through `norm_weight`); the
        node has one qk_norm_epsilon, so differing epsilons are refused."""
        q, k = attn.q_norm, attn.k_norm
        eq, ek = self.norm_eps(q), self.norm_eps(k)
        if eq != ek:
            raise NotImplementedError(f"q_norm eps {eq} != k_norm eps {ek}: the node has one qk_norm_epsilon")
        return self.norm_weight(q), self.norm_weight(k), eq

    def head_sink(self, attn) -> torch.Tensor | None:
        return None

    def attention_softcap(self, config) -> float:
        return 0.0

    def attention_bias(self, ctx: "ExportContext", i: int) -> str | None:
        """A tensor fed to layer i's node as attention_bias (T, [B or 1, H or 1, q_capacity, kv_capacity], added
        after scale: Llama 4's chunk mask), or None."""
        return None

    def attention_scale(self, attn, config) -> float:
        return float(attn.scaling)

    def rotary_interleaved(self, config) -> int:
        return 0

    def embed_multiplier(self, config) -> float:
        """Factor on the embedding output (Granite's embedding_multiplier)."""
        return 1.0

    def logits_multiplier(self, config) -> float:
        """Factor on the logits (Granite: 1 / logits_scaling; Cohere: logit_scale)."""
        return 1.0

    # ---- graph --------------------------------------------------------------------------------
    def build(self, ctx: ExportContext, progress: Iterable[int] | None = None) -> None:
        g, model = ctx.g, ctx.model
        self.make_inputs(ctx)
        self.make_rope(ctx)
        h = self.embed(ctx)
        res = Residual(g, h)
        layers = self.layers(model)
        for i in (progress if progress is not None else range(len(layers))):
            self.decoder_layer(ctx, i, layers[i], res)
        x = res.norm(self.norm(self.decoder(model).norm), None, f"/model/layers.{len(layers)}/final_norm_layernorm",
                     "model.norm.weight")
        self.lm_head(ctx, x)

    def make_inputs(self, ctx: ExportContext) -> None:
        g, spec, io = ctx.g, ctx.spec, ctx.io
        i32 = TensorProto.INT32
        g.input(N.INPUT_IDS, TensorProto.INT64, (_rows(),))
        g.input(io.block_table, i32, ("batch_size", "max_num_blocks"))
        if spec.windowed_layers:
            g.input(io.block_table_windowed, i32, ("batch_size", "max_num_blocks"))
        g.input(io.cumulative_sequence_lengths, i32, ("batch_size + 1",))
        g.input(io.past_sequence_lengths, i32, ("batch_size",))
        g.input(io.attention_metadata, i32, (3,))
        for extra in (io.slot_mapping, io.query_positions):
            if extra:
                g.input(extra, i32, (_rows(),))
        for l in spec.layers:
            blocks = "num_blocks_windowed" if l.windowed_table else "num_blocks"
            for kind, cache in (("key", l.k_cache), ("value", l.v_cache)):
                if cache is None:
                    continue
                # [num_blocks, block_size, kv_heads, D_cache]
                shape = (blocks, "block_size", l.kv_num_heads, cache_width(cache.dtype, l.head_size))
                g.input(N.past_name(kind, l.layer), cache_elem_type(cache.dtype), shape)
            for kind, cache in (("key_scale", l.k_cache), ("value_scale", l.v_cache)):
                if cache is not None and cache.quant == "PER_TOKEN":  # [num_blocks, block_size, kv_heads]
                    g.input(N.past_name(kind, l.layer), TensorProto.FLOAT16, (blocks, "block_size", l.kv_num_heads))

    def make_rope(self, ctx: ExportContext) -> None:
        keys = {l.rope for l in ctx.spec.layers if l.rope}
        if not keys:
            return
        tables = self.rope_tables(ctx.model, ctx.spec.context_length)
        g = ctx.g  # T-typed node inputs: the attention type (fp16 in a float32 export)
        for key in sorted(keys):
            sin_name = key.replace("cos", "sin", 1)
            table = tables[key]
            if isinstance(table, LongRope):  # two tables, one picked per step by the batch's longest sequence
                short = (g.initializer(key, table.short[0], g.attn_type), g.initializer(sin_name, table.short[1], g.attn_type))
                long = (g.initializer(f"{key}_long", table.long[0], g.attn_type),
                        g.initializer(f"{sin_name}_long", table.long[1], g.attn_type))
                ctx.rope[key] = select_tables(g, ctx.io, short, long, table.original, key)
            else:
                ctx.rope[key] = (g.initializer(key, table[0], g.attn_type), g.initializer(sin_name, table[1], g.attn_type))

    def embed(self, ctx: ExportContext) -> str:
        g = ctx.g
        emb = self.decoder(ctx.model).embed_tokens
        w = g.initializer("model.embed_tokens.weight", emb.weight.detach())
        h = g.node("Gather", [w, N.INPUT_IDS], "/model/embed_tokens/Gather", out_type=g.float_type,
                   out_shape=(_rows(), ctx.config.hidden_size))
        return scale(g, h, self.embed_multiplier(ctx.config), "/model/embed_tokens/Mul")

    def decoder_layer(self, ctx: ExportContext, i: int, layer, res: Residual) -> None:
        p = f"/model/layers.{i}"
        x = res.norm(self.norm(layer.input_layernorm), None, f"{p}/input_layernorm",
                     f"model.layers.{i}.input_layernorm.weight")
        res.add(self.attention(ctx, i, layer.self_attn, x), f"{p}/attn")
        x = res.norm(self.norm(layer.post_attention_layernorm), None, f"{p}/post_attention_layernorm",
                     f"model.layers.{i}.post_attention_layernorm.weight")
        res.add(self.ffn(ctx, i, layer, x), f"{p}/mlp")

    def ffn(self, ctx: ExportContext, i: int, layer, x: str) -> str:
        """Layer i's feed-forward block [T, H] -> [T, H]: `mlp` of the layer's `mlp` module by default (a family
        whose layers hold experts elsewhere overrides this)."""
        return self.mlp(ctx, i, layer.mlp, x)

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        def wb(lin):
            return lin.weight, lin.bias
        act = getattr(ctx.config, "hidden_activation", None) or ctx.config.hidden_act
        return gated_mlp(ctx.g, x, wb(mlp.gate_proj), wb(mlp.up_proj), wb(mlp.down_proj), act, i)

    def project_qkv(self, ctx: ExportContext, i: int, attn, x: str) -> tuple[str, str | None, str | None]:
        """(query, key, value) fed to layer i's node: the packed QKV product [T, (Hq + 2 Hkv) * D] with key /
        value None (default), or three tensors when the family transforms Q / K before the node."""
        w, b = self.qkv_weights(attn)
        return linear(ctx.g, x, w, b, f"/model/layers.{i}/attn/qkv_proj", f"model.layers.{i}.attn.qkv_proj"), None, None

    def separate_qkv(self, ctx: ExportContext, i: int, attn, x: str) -> tuple[str, str, str]:
        """Q [T, Hq * D], K / V [T, Hkv * D] as three products of the packed weight's rows (for families that
        transform Q / K before the node)."""
        l = ctx.spec.layers[i]
        w, b = self.qkv_weights(attn)
        sizes = [l.num_heads * l.head_size, l.kv_num_heads * l.head_size, l.kv_num_heads * l.head_size]
        ws, bs = w.split(sizes, 0), b.split(sizes, 0) if b is not None else (None, None, None)
        p, ip = f"/model/layers.{i}/attn", f"model.layers.{i}.attn"
        return tuple(linear(ctx.g, x, wj, bj, f"{p}/{n}_proj", f"{ip}.{n}_proj")
                     for wj, bj, n in zip(ws, bs, "qkv"))

    def attention(self, ctx: ExportContext, i: int, attn, x: str) -> str:
        g, l, config = ctx.g, ctx.spec.layers[i], ctx.config
        ip = f"model.layers.{i}.attn"
        query, key, value = self.project_qkv(ctx, i, attn, x)
        extra: dict[str, str] = {}
        attrs: dict[str, Any] = dict(num_heads=l.num_heads, kv_num_heads=l.kv_num_heads,
                                     scale=self.attention_scale(attn, config),
                                     softcap=self.attention_softcap(config), local_window_size=l.window)
        node_rope = bool(l.rope) and self.rope_in_node(config, i)
        if node_rope:
            attrs.update(do_rotary=1, rotary_interleaved=self.rotary_interleaved(config))
        qk = self.qk_norm(attn)
        if qk is not None:
            extra["q_norm_weight"] = g.initializer(f"{ip}.q_norm.weight", qk[0], g.attn_type)  # T, as the node
            extra["k_norm_weight"] = g.initializer(f"{ip}.k_norm.weight", qk[1], g.attn_type)
            attrs["qk_norm_epsilon"] = qk[2]
        sink = self.head_sink(attn)
        if sink is not None:
            extra["head_sink"] = g.initializer(f"{ip}.sinks", sink.detach(), g.attn_type)
        bias = self.attention_bias(ctx, i)
        if bias is not None:
            extra["attention_bias"] = bias
        caches = self.cache_io(ctx, l, extra, attrs)
        out = paged_attention(g, layer=i, io=ctx.io, query=query, key=key, value=value, caches=caches,
                              windowed_table=l.windowed_table, rope=ctx.rope[l.rope] if node_rope else None,
                              extra_inputs=extra, attrs=attrs, out_width=l.num_heads * l.head_size)
        return self.output_projection(ctx, i, attn, out)

    def output_projection(self, ctx: ExportContext, i: int, attn, out: str) -> str:
        o = attn.o_proj
        return linear(ctx.g, out, o.weight, o.bias, f"/model/layers.{i}/attn/o_proj", f"model.layers.{i}.attn.o_proj")

    def cache_io(self, ctx: ExportContext, l: LayerSpec, extra: dict, attrs: dict) -> dict[str, str]:
        """Cache inputs/outputs of layer l's node and their quantization attributes / static scales."""
        return cache_io(ctx.g, l, ctx.opts.kv_scales.get(l.layer, (None, None)), extra, attrs)

    def lm_head(self, ctx: ExportContext, x: str) -> str:
        g, model, config = ctx.g, ctx.model, ctx.config
        head = model.lm_head
        emb = self.decoder(model).embed_tokens
        vocab = config.vocab_size
        x = cast(g, x, g.float_type, "/lm_head/input/Cast")
        if head.weight is emb.weight:  # tied (one parameter): reuse the embedding table [V, H]
            y = g.node("Gemm", [x, "model.embed_tokens.weight"], "/lm_head/Gemm", transB=1,
                       out_type=g.float_type, out_shape=(_rows(), vocab))
        else:
            y = linear(g, x, head.weight, getattr(head, "bias", None), "/lm_head", "lm_head")
        y = scale(g, y, self.logits_multiplier(config), "/lm_head/Mul")
        y = self.final_softcap(ctx, y)
        if g.float_type == TensorProto.BFLOAT16:  # onnxruntime-genai: float32 logits for bf16 models
            y = cast(g, y, TensorProto.FLOAT, "/lm_head/Cast")
        g.nodes[-1].output[0] = N.LOGITS
        g.vi[N.LOGITS] = g.vi[y]
        g.output(N.LOGITS, g.vi[y][0], (_rows(), vocab))
        return N.LOGITS

    def final_softcap(self, ctx: ExportContext, y: str) -> str:
        return y
